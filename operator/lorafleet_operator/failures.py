"""The operator's one failure and retry policy.

Every decision about what failed how, and whether and when to try again, is made here:

* **classification** — a failed agent call or a Kubernetes API error is *transient* (the agent,
  one of its ranks or the API server is down or busy: ask again soon) or *permanent* (the
  agent answered and refused: the same request would be refused again);
* **back-off** — kopf retries transient failures after ``transient_retry_s · 2^retry`` (capped);
  the drift check retries a permanent failure of one adapter generation on one agent after
  ``failed_retry_s · 2^(attempts-1)`` (capped): slowly, never in a hot loop;
* **deletion** — how long an unreachable agent may hold up a finalizer;
* **handler outcomes** — the one place that raises ``kopf.TemporaryError`` /
  ``kopf.PermanentError`` (:func:`kopf_retries`, around every handler).

Reconcile code reports what happened (:class:`Transient`, :class:`Permanent`, or a Kubernetes
API error escaping); it never builds kopf's errors or computes a delay itself.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import kopf
import urllib3
from kubernetes.client.exceptions import ApiException

from lorafleet_operator.agent_client import AgentError, ControlReply
from lorafleet_operator.config import Settings
from lorafleet_operator.status import AgentResult, AgentState, Phase

#: gRPC codes that say "try again later": the agent or one of its ranks is down or busy.
TRANSIENT_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED,
})

#: What the Kubernetes client raises when the API server refuses, restarts or is overloaded.
#: All of it is retried like an unreachable agent (kopf's default for an unexpected error
#: would wait a whole minute).
KUBE_API_ERRORS = (ApiException, urllib3.exceptions.HTTPError)

#: One agent call that did not succeed: the call failed (a gRPC error), or the agent answered
#: ``success=false`` (its ranks refused).
AgentFailure = AgentError | ControlReply

#: Doubling stops growing here (the caps apply long before; this only bounds the arithmetic).
_MAX_DOUBLINGS = 20


def is_transient(failure: AgentFailure) -> bool:
    """Whether asking again soon can help: only a gRPC error with a transient code."""
    return isinstance(failure, AgentError) and failure.code in TRANSIENT_CODES


def agent_state(failure: AgentFailure) -> AgentState:
    """The status state of an agent whose call failed this way."""
    return AgentState.UNREACHABLE if is_transient(failure) else AgentState.FAILED


def failure_message(failure: AgentFailure, fallback: str) -> str:
    """The agent's own words for a failure (``fallback`` when it gave none)."""
    text = failure.message if isinstance(failure, AgentError) else failure.error_message
    return text or fallback


def backoff(first_s: float, max_s: float, attempt: int) -> float:
    """``first_s`` doubled ``attempt`` times, at most ``max_s`` (attempt 0 waits ``first_s``)."""
    return min(first_s * (1 << min(max(attempt, 0), _MAX_DOUBLINGS)), max_s)


def transient_delay(settings: Settings, retry: int) -> float:
    """kopf's delay after ``retry`` earlier transient failures of one handler."""
    return backoff(settings.transient_retry_s, settings.transient_retry_max_s, retry)


def failed_delay(settings: Settings, attempts: int) -> float:
    """The drift check's delay after the ``attempts``-th permanent failure (1 = the first)."""
    return backoff(settings.failed_retry_s, settings.failed_retry_max_s, attempts - 1)


def delete_waits(settings: Settings, retry: int, failures: Iterable[AgentFailure]) -> bool:
    """Whether a deletion keeps its finalizer and retries: some Ready agent could not be
    reached and the retry budget is not spent. Otherwise it releases anyway (the drift check
    unloads the orphan when the agent answers again)."""
    return retry < settings.delete_retries and any(is_transient(f) for f in failures)


#: (adapter uid, generation, agent pod): one adapter generation on one agent.
FailureKey = tuple[str, int, str]


@dataclass(frozen=True)
class PermanentFailure:
    """A permanent load failure of one adapter generation on one agent, and when to retry."""

    attempts: int
    retry_at: float
    message: str


@dataclass
class SlowRetries:
    """The drift check's book of permanent failures: a failed (generation, agent) is tried
    again only when its back-off has passed. A new generation has a new key, so a spec change
    is tried at once; a success clears the entry."""

    settings: Settings
    clock: Callable[[], float] = time.monotonic
    entries: dict[FailureKey, PermanentFailure] = field(default_factory=dict)

    def record(self, key: FailureKey, message: str) -> None:
        """Count one more permanent failure and schedule the next (slow) try."""
        old = self.entries.get(key)
        attempts = (old.attempts if old else 0) + 1
        retry_at = self.clock() + failed_delay(self.settings, attempts)
        self.entries[key] = PermanentFailure(attempts, retry_at, message)

    def clear(self, key: FailureKey) -> None:
        self.entries.pop(key, None)

    def clear_adapter(self, uid: str) -> None:
        """Forget every failure of a deleted adapter."""
        for key in [k for k in self.entries if k[0] == uid]:
            del self.entries[key]

    def waiting(self, key: FailureKey) -> PermanentFailure | None:
        """The failure whose back-off has not passed yet (None: a try is due)."""
        failure = self.entries.get(key)
        if failure is None or self.clock() >= failure.retry_at:
            return None
        return failure

    def remember(self, key: FailureKey, result: AgentResult) -> None:
        """Book a load's outcome on one agent: a refusal backs off, anything else clears."""
        if result.state is AgentState.FAILED:
            self.record(key, result.message)
        else:
            self.clear(key)


class Transient(Exception):
    """A handler's work is incomplete for a reason that may pass: retry with back-off."""


class Permanent(Exception):
    """A handler's work failed and asking again will not help until the spec changes."""


def check_load(results: Sequence[AgentResult], phase: str, message: str) -> None:
    """After a load and its status write: retry soon while an agent was unreachable; stop when
    nothing holds the adapter and an agent refused it (phase Failed); else done (Degraded
    stays as it is until something changes; the drift check retries refusals slowly)."""
    if any(r.state is AgentState.UNREACHABLE for r in results):
        raise Transient(message)
    if phase == Phase.FAILED:
        raise Permanent(message)


Handler = Callable[..., Awaitable[None]]


def _kube_reason(err: BaseException) -> str:
    return f"{err.status} {err.reason}" if isinstance(err, ApiException) else repr(err)


def kopf_retries(handler: Handler) -> Handler:
    """Wrap a kopf handler: the policy's outcomes become kopf's retry errors, with the delay
    for this retry. Kubernetes API errors count as transient."""

    @functools.wraps(handler)
    async def wrapper(*, retry: int, memo: kopf.Memo, **kwargs: Any) -> None:
        settings: Settings = memo["runtime"].settings  # main.py puts the Runtime in the memo
        try:
            await handler(retry=retry, memo=memo, **kwargs)
        except Transient as err:
            raise kopf.TemporaryError(str(err), delay=transient_delay(settings, retry)) from err
        except KUBE_API_ERRORS as err:
            raise kopf.TemporaryError(f"Kubernetes API: {_kube_reason(err)}",
                                      delay=transient_delay(settings, retry)) from err
        except Permanent as err:
            raise kopf.PermanentError(str(err)) from err

    return wrapper
