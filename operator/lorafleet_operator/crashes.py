"""Crashes during loads: a load that was in flight when its agent died or hung counts against
that adapter generation (:class:`CrashBook`); after ``load_crash_budget`` such agent deaths
the generation is condemned: Failed (``LoadCrashedAgent``), sent to no agent until the spec
changes. Part of the operator's one failure policy (:mod:`~lorafleet_operator.failures`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from lorafleet_operator.agent_values import AgentError, ControlReply
from lorafleet_operator.fleet import AgentPod
from lorafleet_operator.reasons import Reason
from lorafleet_operator.resources import AdapterGeneration

#: Codes with which a load can end without the agent having answered it: its process died
#: (connection reset or closed: UNAVAILABLE) or hung (the operator's deadline fired).
UNANSWERED_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
#: Reasons an agent gives (trailing metadata ``lorafleet-reason``) when its engine stopped
#: serving under the call: the agent is about to exit, as if it had died during the load.
ENGINE_DIED_REASONS = frozenset({"engine_unavailable"})


def died_under(err: AgentError) -> bool:
    """Whether a failed load may be the agent dying or hanging under it (a crash candidate):
    the call ended without an answer of the agent's own (no ``lorafleet-reason``; a transport
    error or the operator's deadline), or the agent said its engine stopped serving. An error
    the agent answered with its own reason (a download timeout, too many downloads) is not."""
    if err.reason:
        return err.reason in ENGINE_DIED_REASONS
    return err.code in UNANSWERED_CODES


def answered(failure: AgentError | ControlReply) -> bool:
    """Whether the agent itself answered a failed load (a refusal, or an error of its own):
    it is alive, and its registry says what it still serves."""
    return isinstance(failure, ControlReply) or not died_under(failure)


#: (pod uid, container restarts): one life of an agent process; a restart starts a new one.
Incarnation = tuple[str, int]


def incarnation(pod: AgentPod) -> Incarnation:
    return (pod.uid, pod.restarts)


@dataclass(frozen=True)
class Suspect:
    """A load of one generation on one agent life that ended without the agent's answer."""

    incarnation: Incarnation
    #: No other load was in flight on that agent during this one: a death is this load's.
    alone: bool
    message: str


@dataclass
class CrashBook:
    """Which adapter generations were being loaded when their agent died or hung.

    A load that ended without the agent's answer (:func:`died_under`) makes that (generation,
    agent) a *suspect*. The next look at the fleet (:meth:`observe`) settles it: the same pod
    not Ready (its container exited or its probe failed: dead or hung; a network fault between
    the operator and the agent leaves the kubelet's probe alone) or with more container
    restarts means the agent died or hung during the load — a **crash**; a re-created pod
    (new uid) drops the suspect; a later answered load on the same agent life clears it (the
    failure was the network: a stall or a partition). A crash counts
    against the generation only when that load was alone on the agent; one with company is
    *ambiguous* and makes the generation's next loads run alone on their agent (exclusive), so
    the next death is attributed exactly. ``budget`` counted crashes (distinct agent lives)
    condemn the generation (:meth:`verdict`). A success on an agent clears the suspicion
    there. A new generation is a new key: a spec change is tried again.
    """

    budget: int
    suspects: dict[AdapterGeneration, dict[str, Suspect]] = field(default_factory=dict)
    crashes: dict[AdapterGeneration, dict[tuple[str, Incarnation], str]] = field(default_factory=dict)
    ambiguous: set[AdapterGeneration] = field(default_factory=set)

    def suspect(self, key: AdapterGeneration, pod: str, life: Incarnation, *, alone: bool, message: str) -> None:
        self._forget_older(key)
        self.suspects.setdefault(key, {})[pod] = Suspect(life, alone, message)

    def answered(self, key: AdapterGeneration, pod: str, *, loaded: bool) -> None:
        """The agent answered a load of this generation (success, refusal or its own error):
        whatever was suspected of it there was not a death; a success also lifts isolation."""
        self.suspects.get(key, {}).pop(pod, None)
        if loaded:
            self.ambiguous.discard(key)

    def observe(self, pods: Iterable[AgentPod]) -> None:
        """Settle suspects against the fleet's pods as they are now (:class:`CrashBook`)."""
        now = {p.name: p for p in pods}
        for key, by_pod in self.suspects.items():
            for name, suspect in list(by_pod.items()):
                pod = now.get(name)
                if pod is None:
                    continue  # not in this look (another fleet, or gone): settled elsewhere
                uid, restarts = suspect.incarnation
                if pod.uid != uid:
                    del by_pod[name]  # a new pod, not a restart: nothing to count
                elif pod.restarts > restarts or not pod.ready:
                    del by_pod[name]
                    if suspect.alone:
                        self.crashes.setdefault(key, {})[(name, suspect.incarnation)] = suspect.message
                    else:
                        self.ambiguous.add(key)

    def isolate(self, key: AdapterGeneration) -> bool:
        """Whether this generation's loads must run with no other load on their agent."""
        return key in self.ambiguous or bool(self.suspects.get(key)) or bool(self.crashes.get(key))

    def verdict(self, key: AdapterGeneration) -> str:
        """Why this generation is sent to no agent any more ("" while it may be)."""
        crashes = self.crashes.get(key, {})
        if len(crashes) < self.budget:
            return ""
        agents = sorted({pod for pod, _ in crashes})
        what = "; ".join(f"{pod} (restart {life[1]}): {message}" for (pod, life), message in sorted(crashes.items()))
        return (
            f"generation {key[1]} was being loaded when {len(crashes)} agent processes "
            f"died or hung ({', '.join(agents)}; the crash budget is {self.budget}): "
            f"{what}; not sent to any agent until the spec changes"
        )

    def forget(self, uid: str) -> None:
        """Forget a deleted adapter."""
        for book in (self.suspects, self.crashes):
            for key in [k for k in book if k[0] == uid]:
                del book[key]
        self.ambiguous = {k for k in self.ambiguous if k[0] != uid}

    def _forget_older(self, key: AdapterGeneration) -> None:
        """A newer generation replaces what was known of older ones."""
        for book in (self.suspects, self.crashes):
            for old in [k for k in book if k[0] == key[0] and k[1] < key[1]]:
                del book[old]
        self.ambiguous = {k for k in self.ambiguous if not (k[0] == key[0] and k[1] < key[1])}


def crash_verdict(book: CrashBook, key: AdapterGeneration, status: Mapping[str, Any] | None) -> str:
    """Why this generation is condemned: this process's own count, or — across operator
    restarts — a stored Ready condition of this generation with reason ``LoadCrashedAgent``
    (the status is the durable record). "" when it may be loaded."""
    verdict = book.verdict(key)
    if verdict:
        return verdict
    for cond in (status or {}).get("conditions") or []:
        if (
            cond.get("type") == "Ready"
            and cond.get("reason") == Reason.LOAD_CRASHED_AGENT
            and int(cond.get("observedGeneration", -1)) == key[1]
        ):
            return str(cond.get("message") or "its loads crashed agents")
    return ""
