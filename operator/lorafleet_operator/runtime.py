"""State one operator process shares between its handlers (handed to them as kopf's ``memo``).

Only caches and coordination live here: the truth is always re-read from the API server and
the agents. Losing all of it (a restart) costs at most one extra round of calls.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from lorafleet_operator.agent_client import AgentClients, AgentInfo
from lorafleet_operator.config import Settings
from lorafleet_operator.failures import CrashBook, SlowRetries
from lorafleet_operator.kube import Kube


@dataclass
class Runtime:
    """The process's settings, clients, caches and locks (kopf's ``memo["runtime"]``)."""

    settings: Settings
    kube: Kube
    agents: AgentClients
    #: One lock per LoraAdapter: its handlers and the drift check never act on it at once.
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    #: Permanent load failures per (adapter uid, generation, pod), and when to try again.
    failures: SlowRetries = field(init=False)
    #: Loads in flight when their agent died or hung, per adapter generation.
    crashes: CrashBook = field(init=False)
    #: (pod uid, restarts, endpoint) -> the agent's Describe.
    describe_cache: dict[tuple[str, int, str], AgentInfo] = field(default_factory=dict)
    #: One lock per LoraFleet: its drift check and its deletion never run at once.
    fleet_locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    #: (namespace, fleet) -> set to run that fleet's drift check now instead of at its interval.
    pokes: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    #: (namespace, pod) -> (exists, ready, ip, restarts) last seen, to poke only on changes.
    pods_seen: dict[tuple[str, str], tuple[object, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.failures = SlowRetries(self.settings)
        self.crashes = CrashBook(self.settings.load_crash_budget)

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        """The adapter's lock, made on first use."""
        return self.locks.setdefault((namespace, name), asyncio.Lock())

    def fleet_lock(self, namespace: str, fleet: str) -> asyncio.Lock:
        """The fleet's lock, made on first use."""
        return self.fleet_locks.setdefault((namespace, fleet), asyncio.Lock())

    def poke(self, namespace: str, fleet: str) -> asyncio.Event:
        """The event that wakes a fleet's drift check early."""
        return self.pokes.setdefault((namespace, fleet), asyncio.Event())
