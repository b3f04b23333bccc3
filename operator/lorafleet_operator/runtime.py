"""State one operator process shares between its handlers (handed to them as kopf's ``memo``).

Only caches and coordination live here: the truth is always re-read from the API server and
the agents. Losing all of it (a restart) costs at most one extra round of calls.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from lorafleet_operator.agent_client import AgentClients, AgentInfo
from lorafleet_operator.config import Settings
from lorafleet_operator.kube import Kube


@dataclass
class Failure:
    """A permanent load failure of one adapter generation on one agent, and when to retry."""

    attempts: int
    retry_at: float
    message: str


@dataclass
class Runtime:
    settings: Settings
    kube: Kube
    agents: AgentClients
    #: One lock per LoraAdapter: its handlers and the drift check never act on it at once.
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    #: (adapter uid, generation, pod) -> the last permanent failure there.
    failures: dict[tuple[str, int, str], Failure] = field(default_factory=dict)
    #: (pod uid, restarts, endpoint) -> the agent's Describe.
    describe_cache: dict[tuple[str, int, str], AgentInfo] = field(default_factory=dict)
    #: (namespace, fleet) -> set to run that fleet's drift check now instead of at its interval.
    pokes: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    #: (namespace, pod) -> (exists, ready, ip, restarts) last seen, to poke only on changes.
    pods_seen: dict[tuple[str, str], tuple[object, ...]] = field(default_factory=dict)

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self.locks.setdefault((namespace, name), asyncio.Lock())

    def poke(self, namespace: str, fleet: str) -> asyncio.Event:
        return self.pokes.setdefault((namespace, fleet), asyncio.Event())

    def record_failure(self, key: tuple[str, int, str], message: str) -> None:
        """Count one more permanent failure and schedule the next (slow) retry."""
        old = self.failures.get(key)
        attempts = (old.attempts if old else 0) + 1
        delay = self.settings.failed_delay(attempts)
        self.failures[key] = Failure(attempts, time.monotonic() + delay, message)

    def retry_due(self, key: tuple[str, int, str]) -> bool:
        failure = self.failures.get(key)
        return failure is None or time.monotonic() >= failure.retry_at
