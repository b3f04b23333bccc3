"""The operator's one failure and retry policy.

Every decision about what failed how, and whether and when to try again, is made here:

* **classification** — a failed agent call or a Kubernetes API error is *transient* (the agent,
  one of its ranks or the API server is down or busy: ask again soon) or *permanent* (the
  agent answered and refused: the same request would be refused again);
* **back-off** — every failed load of one adapter generation on one agent is booked
  (:class:`LoadRetries`), and neither a handler nor the drift check loads there again before
  its wait has passed: growing with consecutive failures (transient from ``transient_retry_s``,
  refusals from ``failed_retry_s``), capped, jittered (:func:`load_retry_delay`); other
  transient handler failures wait kopf's jittered ``transient_retry_s · 2^retry``; a drift
  check that failed on the Kubernetes API waits longer each time (:func:`drift_delay`); kopf's
  own API requests retry endlessly with a capped doubling (:func:`kopf_api_backoffs`);
* **deletion** — how long an unreachable agent may hold up a finalizer;
* **crashes during loads** — a load that was in flight when its agent died or hung counts
  against that adapter generation (:class:`~lorafleet_operator.crashes.CrashBook`, in a module
  of its own); after ``load_crash_budget`` such agent deaths the generation is condemned:
  Failed (``LoadCrashedAgent``), sent to no agent until the spec changes;
* **an unusable fleet** — a missing or deleted LoraFleet, a Secret not opened to lorafleet (or
  whose read the API server refused with a 4xx: :func:`kube_refused`), a token that is no valid
  header value (:func:`bearer_token`) are :class:`FleetProblem`: permanent, one object's alone,
  never retried by kopf (the adapter is Pending with the reason; the drift check and a
  changed spec look again);
* **handler outcomes** — the one place that raises ``kopf.TemporaryError`` /
  ``kopf.PermanentError`` (:func:`kopf_retries`, around every handler).

Reconcile code reports what happened (:class:`Transient`, :class:`Permanent`, or a Kubernetes
API error escaping); it never builds kopf's errors or computes a delay itself.
"""

from __future__ import annotations

import functools
import itertools
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import kopf
import urllib3
from kubernetes.client.exceptions import ApiException

from lorafleet_operator.agent_values import AgentError, ControlReply
from lorafleet_operator.conditions import rfc3339
from lorafleet_operator.config import Settings
from lorafleet_operator.crashes import Incarnation
from lorafleet_operator.reasons import Reason
from lorafleet_operator.resources import FailureKey
from lorafleet_operator.status import AgentResult, AgentState, Phase

#: gRPC codes that say "try again later": the agent or one of its ranks is down or busy.
TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
    }
)

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
    """Whether asking again soon can help: a gRPC error with a transient code, or an answer
    whose failed ranks could not act now (none refused: a stock server down or busy)."""
    if isinstance(failure, AgentError):
        return failure.code in TRANSIENT_CODES
    return failure.transient


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


def retry_after(err: BaseException) -> float:
    """The server's Retry-After (seconds) on a Kubernetes API error (429), 0 without one."""
    headers = getattr(err, "headers", None) if isinstance(err, ApiException) else None
    try:
        return max(float((headers or {}).get("Retry-After") or 0), 0.0)
    except (TypeError, ValueError):
        return 0.0


def drift_delay(settings: Settings, api_failures: int, retry_after_s: float = 0.0) -> float:
    """The wait before a fleet's next drift check: the interval; after ``api_failures``
    consecutive checks that failed on the Kubernetes API, the interval doubled per failure up
    to ``max(interval, transient_retry_max_s)``, and never less than the server's Retry-After."""
    interval = settings.drift_interval_s
    if api_failures <= 0:
        return interval
    longest = max(interval, settings.transient_retry_max_s)
    return max(backoff(interval, longest, api_failures - 1), retry_after_s)


def loop_stall_s(settings: Settings) -> float:
    """How long a fleet's drift loop may go without finishing a round before the process
    counts as wedged (liveness fails): three of its longest waits (the interval, or the
    API back-off's cap) plus one load's deadline (a round may wait for a load)."""
    return 3 * max(settings.drift_interval_s, settings.transient_retry_max_s) + settings.load_deadline_s


def stalled_loops(heartbeats: Mapping[tuple[str, str], float], now: float, settings: Settings) -> list[str]:
    """The fleets ("ns/name") whose drift loop last finished a round (or started) longer
    than :func:`loop_stall_s` ago, by the monotonic clock."""
    limit = loop_stall_s(settings)
    return sorted(f"{ns}/{name}" for (ns, name), beat in heartbeats.items() if now - beat > limit)


@dataclass(frozen=True)
class EndlessBackoff:
    """kopf's retries of its own API requests (watches, its patches, events): doubling from
    ``first_s`` to ``max_s``, never giving up. kopf's default gives up after 9 attempts
    (about a minute), and a watch that gives up on a 5xx ends the whole operator: an API
    server or etcd outage longer than that would crash it. Iterable again for every request
    (kopf iterates it per request); not Sized, so kopf counts attempts without a total."""

    first_s: float
    max_s: float

    def __iter__(self) -> Iterator[float]:
        return (backoff(self.first_s, self.max_s, n) for n in itertools.count())


def kopf_api_backoffs(settings: Settings) -> EndlessBackoff:
    """The back-off kopf uses for its own failed API requests (set at startup)."""
    return EndlessBackoff(settings.transient_retry_s, settings.transient_retry_max_s)


def delete_waits(settings: Settings, retry: int, failures: Iterable[AgentFailure]) -> bool:
    """Whether a deletion keeps its finalizer and retries: some Ready agent could not be
    reached and the retry budget is not spent. Otherwise it releases anyway (the drift check
    unloads the orphan when the agent answers again)."""
    return retry < settings.delete_retries and any(is_transient(f) for f in failures)


#: A retry waits between ``1 - JITTER`` and 1 times its back-off (chosen at random), so agents
#: (and adapters) that failed together do not all ask again at the same instant.
JITTER = 0.5


def jittered(delay_s: float, draw: float) -> float:
    """``delay_s`` shortened by up to :data:`JITTER` of itself; ``draw`` is uniform in [0, 1)."""
    return delay_s * (1.0 - JITTER * draw)


def load_retry_delay(settings: Settings, state: AgentState, attempts: int, draw: float) -> float:
    """The wait after the ``attempts``-th consecutive failed load of one generation on one
    agent (1 = the first): a transient failure (agent down or busy, a source answering 503)
    doubles from ``transient_retry_s`` up to ``transient_retry_max_s``; a refusal doubles
    from ``failed_retry_s`` up to ``failed_retry_max_s``; either jittered."""
    if state is AgentState.UNREACHABLE:
        return jittered(transient_delay(settings, attempts - 1), draw)
    return jittered(failed_delay(settings, attempts), draw)


@dataclass(frozen=True)
class LoadBackoff:
    """Consecutive failed loads of one adapter generation on one agent, and when to retry.

    ``result`` is the last attempt's outcome with ``next_retry`` (wall clock) filled in: what
    the status shows for that agent until then."""

    attempts: int
    retry_at: float
    life: Incarnation
    result: AgentResult


@dataclass
class LoadRetries:
    """The one book of load retries, obeyed by the handlers and the drift check alike: a
    (generation, agent) whose last load failed is tried again only when its back-off
    (:func:`load_retry_delay`) has passed. The back-off grows with consecutive failures,
    transient or permanent, with a cap and jitter; a success clears it. A new generation is
    a new key (a spec change is tried at once), and so is a new life of the agent (a
    restarted agent lost its registry and is asked at once)."""

    settings: Settings
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time
    draw: Callable[[], float] = random.random
    entries: dict[FailureKey, LoadBackoff] = field(default_factory=dict)

    def remember(self, key: FailureKey, life: Incarnation, result: AgentResult) -> AgentResult:
        """Book a load attempt's outcome on one agent; returns it with its next retry time
        (a success clears the entry and is returned as it is)."""
        if result.state is AgentState.LOADED:
            self.clear(key)
            return result
        old = self.entries.get(key)
        attempts = (old.attempts if old is not None and old.life == life else 0) + 1
        delay = load_retry_delay(self.settings, result.state, attempts, self.draw())
        booked = replace(result, next_retry=rfc3339(self.wall_clock() + delay))
        self.entries[key] = LoadBackoff(attempts, self.clock() + delay, life, booked)
        return booked

    def clear(self, key: FailureKey) -> None:
        self.entries.pop(key, None)

    def clear_adapter(self, uid: str) -> None:
        """Forget every failure of a deleted adapter."""
        for key in [k for k in self.entries if k[0] == uid]:
            del self.entries[key]

    def waiting(self, key: FailureKey, life: Incarnation) -> LoadBackoff | None:
        """The back-off of this key on this agent life that has not passed yet (None: a try
        is due)."""
        entry = self.entries.get(key)
        if entry is None or entry.life != life or self.clock() >= entry.retry_at:
            return None
        return entry

    def failing_pods(self) -> frozenset[str]:
        """The agent pods with a failed load in the book (of any adapter, not yet retried
        with success): placement gives new adapters to the others first."""
        return frozenset(pod for (_, _, pod), entry in self.entries.items() if entry.result.state is AgentState.FAILED)

    def due_in(self, keys: Iterable[FailureKey]) -> float | None:
        """Seconds until the first of these keys' retries is due (0 when one is due now);
        None when none of them is backing off."""
        now = self.clock()
        waits = [max(self.entries[k].retry_at - now, 0.0) for k in keys if k in self.entries]
        return min(waits) if waits else None


class Transient(Exception):
    """A handler's work is incomplete for a reason that may pass: retry with back-off —
    after ``delay_s`` when the load back-off book says when (:meth:`LoadRetries.due_in`),
    else after kopf's jittered transient delay for this retry."""

    def __init__(self, message: str, delay_s: float | None = None) -> None:
        super().__init__(message)
        self.delay_s = delay_s


class Permanent(Exception):
    """A handler's work failed and asking again will not help until the spec changes."""


class FleetProblem(Permanent):
    """The fleet cannot be used as declared: missing or being deleted, a Secret that is not
    opened to lorafleet, an invalid token. Permanent: the handler writes Pending with
    ``reason`` and stops; nothing retries it in a loop (the drift check looks at the fleet
    again at its interval, so a fixed Secret or a new fleet is picked up then)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def bearer_token(raw: bytes) -> str:
    """A token Secret's value as the bearer token to send: surrounding whitespace (a trailing
    newline from ``echo`` or a file) is trimmed; anything left that is not printable ASCII (a
    control character, a newline inside, non-ASCII) is refused once, as permanent — gRPC would
    refuse every call with "Illegal header value". The message never shows the value."""
    token = raw.strip(b" \t\r\n\f\v")
    if not token:
        raise FleetProblem(Reason.INVALID_TOKEN, "the fleet's bearer token is empty (after trimming surrounding whitespace)")
    bad = sum(1 for b in token if not 0x20 <= b <= 0x7E)
    if bad:
        raise FleetProblem(
            Reason.INVALID_TOKEN,
            f"the fleet's bearer token cannot be sent as a header "
            f"value: it contains {bad} control or non-ASCII "
            f"byte(s) after trimming surrounding whitespace; "
            f"nothing is sent to the agents until the Secret is "
            f"fixed",
        )
    return token.decode("ascii")


def check_load(results: Sequence[AgentResult], phase: str, message: str, *, condemned: bool = False, due_in: float | None = None) -> None:
    """After a load and its status write: stop when the generation is condemned (its loads
    crashed agents: nothing will be sent) or when nothing holds the adapter and an agent
    refused it (phase Failed); retry while an agent was unreachable, when the first of its
    load back-offs is due (``due_in``); else done (Degraded stays as it is until something
    changes; the drift check retries refusals slowly)."""
    if condemned:
        raise Permanent(message)
    if any(r.state is AgentState.UNREACHABLE for r in results):
        raise Transient(message, due_in)
    if phase == Phase.FAILED:
        raise Permanent(message)


Handler = Callable[..., Awaitable[None]]


def kube_reason(err: BaseException) -> str:
    """A Kubernetes API error in a few words (status and reason), for one log line."""
    return f"{err.status} {err.reason}" if isinstance(err, ApiException) else repr(err)


#: Client errors (4xx) that still say "ask again": a timeout, a conflict, throttling.
RETRIED_CLIENT_ERRORS = frozenset({408, 409, 429})


def kube_refused(err: BaseException) -> bool:
    """Whether the Kubernetes API refused a request for what it asks (a 4xx other than
    :data:`RETRIED_CLIENT_ERRORS`, e.g. 400 for a malformed name): the same request would be
    refused again, so it is the asking object's permanent error. 5xx, timeouts and lost
    connections are transient."""
    return (
        isinstance(err, ApiException)
        and isinstance(err.status, int)
        and 400 <= err.status < 500
        and err.status not in RETRIED_CLIENT_ERRORS
    )


def kopf_retries(handler: Handler) -> Handler:
    """Wrap a kopf handler: the policy's outcomes become kopf's retry errors, with the delay
    for this retry. Kubernetes API errors count as transient."""

    @functools.wraps(handler)
    async def wrapper(*, retry: int, memo: kopf.Memo, **kwargs: Any) -> None:
        settings: Settings = memo["runtime"].settings  # main.py puts the Runtime in the memo
        try:
            await handler(retry=retry, memo=memo, **kwargs)
        except Transient as err:
            delay = err.delay_s if err.delay_s is not None else jittered(transient_delay(settings, retry), random.random())
            raise kopf.TemporaryError(str(err), delay=delay) from err
        except KUBE_API_ERRORS as err:
            raise kopf.TemporaryError(
                f"Kubernetes API: {kube_reason(err)}", delay=jittered(transient_delay(settings, retry), random.random())
            ) from err
        except Permanent as err:
            raise kopf.PermanentError(str(err)) from err

    return wrapper
