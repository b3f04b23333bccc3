"""The failure and retry policy (lorafleet_operator.failures) as plain decisions: which failures
are transient, the back-off delays, the deletion budget, the drift check's slow retries, what a
load's outcome means for the handler, the crash budget of loads during which agents died — and
the settings it reads, from the environment. Also the agent client's load gate (isolated loads)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest
import urllib3
from kubernetes.client.exceptions import ApiException

from lorafleet_operator.agent_values import AgentError, ControlReply
from lorafleet_operator.config import ENV_VARS, Settings
from lorafleet_operator.crashes import CrashBook, crash_verdict, died_under
from lorafleet_operator.failures import (
    KUBE_API_ERRORS,
    FleetProblem,
    LoadRetries,
    Permanent,
    Transient,
    agent_state,
    backoff,
    bearer_token,
    check_load,
    delete_waits,
    drift_delay,
    failed_delay,
    is_transient,
    jittered,
    kopf_api_backoffs,
    kube_refused,
    loop_stall_s,
    retry_after,
    stalled_loops,
    transient_delay,
)
from lorafleet_operator.fleet import AgentPod
from lorafleet_operator.fleet_secrets import ALLOW_ANNOTATION, ALLOW_LABEL, opened_secret, opened_to
from lorafleet_operator.kube import Kube, SecretData
from lorafleet_operator.load_gate import LoadGate
from lorafleet_operator.reasons import Reason
from lorafleet_operator.status import AgentResult, AgentState, Phase, build_status

REFUSED = ControlReply(success=False, error_message="sha256 mismatch", ranks_ok=0, ranks_reported=2)
DOWN = AgentError(grpc.StatusCode.UNAVAILABLE, "connection refused")
SETTINGS = Settings(transient_retry_s=2.0, transient_retry_max_s=60.0, failed_retry_s=300.0, failed_retry_max_s=3600.0, delete_retries=5)


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
    ],
)
def test_busy_or_down_agents_are_transient(code: grpc.StatusCode) -> None:
    assert is_transient(AgentError(code, "x"))
    assert agent_state(AgentError(code, "x")) is AgentState.UNREACHABLE


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
    ],
)
def test_other_codes_and_refusals_are_permanent(code: grpc.StatusCode) -> None:
    assert not is_transient(AgentError(code, "x"))
    assert agent_state(AgentError(code, "x")) is AgentState.FAILED
    # An agent that answered success=false refused: the same request would be refused again.
    assert not is_transient(REFUSED)
    assert agent_state(REFUSED) is AgentState.FAILED


def test_an_answer_whose_failed_ranks_could_not_act_is_transient() -> None:
    """The agent answered, but its failed ranks were stock servers that were down or busy: asking
    again soon may work, so the agent is Unreachable there and retried on the transient schedule."""
    down = replace(REFUSED, error_message="server 1 (http://10.0.0.1:8000) refused the load: Unreachable", transient=True)
    assert is_transient(down)
    assert agent_state(down) is AgentState.UNREACHABLE


def test_kubernetes_api_errors_are_the_clients_own() -> None:
    assert isinstance(ApiException(status=503, reason="Service Unavailable"), KUBE_API_ERRORS)
    assert isinstance(urllib3.exceptions.ProtocolError("connection reset"), KUBE_API_ERRORS)


def test_backoff_doubles_from_the_first_delay_up_to_the_cap() -> None:
    assert [backoff(2.0, 60.0, n) for n in range(7)] == [2, 4, 8, 16, 32, 60, 60]
    assert backoff(2.0, 60.0, 10_000) == 60  # no overflow for long-failing handlers
    assert [transient_delay(SETTINGS, n) for n in (0, 1, 5)] == [2, 4, 60]
    # The drift check counts attempts from 1: the first failure waits the first delay.
    assert [failed_delay(SETTINGS, n) for n in (1, 2, 3, 4, 5, 6)] == [300, 600, 1200, 2400, 3600, 3600]


def test_deletion_waits_only_for_unreachable_agents_and_only_so_long() -> None:
    assert delete_waits(SETTINGS, 0, [DOWN])
    assert delete_waits(SETTINGS, 4, [REFUSED, DOWN])
    assert not delete_waits(SETTINGS, 5, [DOWN])  # the budget is spent: release anyway
    assert not delete_waits(SETTINGS, 0, [REFUSED])  # a refusal would not change on retry
    assert not delete_waits(SETTINGS, 0, [])


class Clock:
    """A hand-moved monotonic clock."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


LIFE = ("pod-uid", 0)


def refused(pod: str = "agent-1") -> AgentResult:
    return AgentResult(pod, AgentState.FAILED, 0, 2, "sha256 mismatch")


def unavailable(pod: str = "agent-1") -> AgentResult:
    return AgentResult(pod, AgentState.UNREACHABLE, 0, 2, "HTTP 503 from the source")


def test_load_retries_back_off_per_generation_and_agent() -> None:
    clock = Clock()
    book = LoadRetries(SETTINGS, clock=clock, wall_clock=lambda: 1_000_000.0, draw=lambda: 0.0)
    key, other_agent, next_generation = ("uid", 1, "agent-1"), ("uid", 1, "agent-0"), ("uid", 2, "agent-1")
    assert book.waiting(key, LIFE) is None  # never failed: due at once
    booked = book.remember(key, LIFE, refused())
    waiting = book.waiting(key, LIFE)
    assert waiting is not None and (waiting.attempts, waiting.result) == (1, booked)
    # The status shows when: 300 s after the (wall-clock) failure.
    assert booked.next_retry == "1970-01-12T13:51:40Z" and booked.message == "sha256 mismatch"
    assert book.waiting(other_agent, LIFE) is None and book.waiting(next_generation, LIFE) is None
    assert book.waiting(key, ("pod-uid", 1)) is None  # a restarted agent is asked at once
    clock.now += 299
    assert book.waiting(key, LIFE) is not None
    clock.now += 1
    assert book.waiting(key, LIFE) is None  # 300 s passed: one more try
    book.remember(key, LIFE, refused())
    clock.now += 599
    assert book.waiting(key, LIFE) is not None  # the second failure waits twice as long
    clock.now += 1
    assert book.waiting(key, LIFE) is None


def test_transient_load_failures_back_off_too_growing_to_the_cap() -> None:
    """A source answering 503 (or a busy agent) is no reason to ask at every drift check: the
    waits double from transient_retry_s up to transient_retry_max_s, whoever asks next."""
    clock = Clock()
    book = LoadRetries(SETTINGS, clock=clock, draw=lambda: 0.0)
    key = ("uid", 1, "agent-1")
    waits = []
    for _ in range(8):
        book.remember(key, LIFE, unavailable())
        due = book.due_in([key])
        assert due is not None
        waits.append(due)
        clock.now += due
    assert waits == [2, 4, 8, 16, 32, 60, 60, 60]
    # A refusal after transient failures keeps counting, on the slow schedule.
    book.remember(key, LIFE, refused())
    assert book.due_in([key]) == 3600


def test_jitter_shortens_each_wait_by_up_to_half() -> None:
    assert [jittered(60, d) for d in (0.0, 0.5, 0.999)] == [60, 45, pytest.approx(30.03)]
    draws = iter([0.0, 0.99])
    clock = Clock()
    book = LoadRetries(SETTINGS, clock=clock, draw=lambda: next(draws))
    book.remember(("uid", 1, "agent-0"), LIFE, unavailable("agent-0"))
    book.remember(("uid", 1, "agent-1"), LIFE, unavailable())
    assert book.due_in([("uid", 1, "agent-0")]) == 2
    assert book.due_in([("uid", 1, "agent-1")]) == pytest.approx(1.01)
    assert book.due_in([("uid", 1, "agent-0"), ("uid", 1, "agent-1")]) == pytest.approx(1.01)
    assert book.due_in([("uid", 2, "agent-0")]) is None


def test_load_retries_forget_successes_and_deleted_adapters() -> None:
    book = LoadRetries(SETTINGS, clock=Clock())
    book.remember(("a", 1, "agent-0"), LIFE, refused("agent-0"))
    book.remember(("a", 1, "agent-1"), LIFE, refused())
    book.remember(("b", 1, "agent-0"), LIFE, refused("agent-0"))
    assert book.waiting(("a", 1, "agent-0"), LIFE) is not None
    loaded = AgentResult("agent-0", AgentState.LOADED, 2, 2)
    assert book.remember(("a", 1, "agent-0"), LIFE, loaded) == loaded
    assert book.waiting(("a", 1, "agent-0"), LIFE) is None
    book.clear_adapter("b")
    assert set(book.entries) == {("a", 1, "agent-1")}


LOADED = AgentResult("agent-0", AgentState.LOADED, 2, 2)
FAILED = AgentResult("agent-1", AgentState.FAILED, 0, 2, "sha256 mismatch")
UNREACHABLE = AgentResult("agent-1", AgentState.UNREACHABLE, 0, 2, "connection refused")


def test_a_load_retries_while_an_agent_is_unreachable_and_stops_when_refused() -> None:
    check_load([LOADED], Phase.READY, "")
    check_load([LOADED, FAILED], Phase.DEGRADED, "sha256 mismatch")  # done until a change
    check_load([], Phase.PENDING, "no ready agent")  # a new agent pod pokes the drift check
    with pytest.raises(Transient, match="connection refused"):
        check_load([LOADED, UNREACHABLE], Phase.DEGRADED, "connection refused")
    with pytest.raises(Permanent, match="sha256 mismatch"):
        check_load([AgentResult("agent-0", AgentState.FAILED, 0, 2, "sha256 mismatch"), FAILED], Phase.FAILED, "sha256 mismatch")


def test_settings_from_the_environment_default_to_the_fields_defaults() -> None:
    assert Settings.from_env({}) == Settings(namespaces=("default",), identity=Settings.from_env({}).identity)
    env = {
        "LORAFLEET_DRIFT_INTERVAL_SECONDS": "1.5",
        "LORAFLEET_DELETE_RETRIES": "2",
        "LORAFLEET_WATCH_NAMESPACES": "a, b,",
        "LORAFLEET_LEASE_NAMESPACE": "ops",
        "POD_NAME": "op-0",
        "LORAFLEET_LEASE_NAME": " ",
    }
    settings = Settings.from_env(env)
    assert (settings.drift_interval_s, settings.delete_retries) == (1.5, 2)
    assert (settings.namespaces, settings.lease_namespace, settings.identity) == (("a", "b"), "ops", "op-0")
    assert settings.lease_name == "lorafleet-operator"  # blank means unset
    assert Settings.from_env({"LORAFLEET_LEASE_NAMESPACE": "ops"}).namespaces == ("ops",)
    # Every setting has its variable (docs/operator.md lists them).
    assert set(ENV_VARS) == set(Settings.__dataclass_fields__)


def test_check_load_stops_for_a_condemned_generation_even_with_agents_down() -> None:
    with pytest.raises(Permanent, match="crashed"):
        check_load([UNREACHABLE], Phase.LOADING, "its loads crashed agents", condemned=True)


@pytest.mark.parametrize(
    ("err", "crash_candidate"),
    [
        # No answer of the agent's own: its process died under the call, or the deadline fired.
        (AgentError(grpc.StatusCode.UNAVAILABLE, "Socket closed"), True),
        (AgentError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), True),
        # The agent answered with its own reason: its engine stopped serving (it is exiting) ...
        (AgentError(grpc.StatusCode.UNAVAILABLE, "engine is not serving", reason="engine_unavailable"), True),
        # ... or a download timed out / too many downloads: retryable, never a crash.
        (AgentError(grpc.StatusCode.UNAVAILABLE, "did not finish within the 600-s download deadline", reason="download_failed"), False),
        (AgentError(grpc.StatusCode.RESOURCE_EXHAUSTED, "8 downloads", reason="too_many_downloads"), False),
        (AgentError(grpc.StatusCode.RESOURCE_EXHAUSTED, "no reason"), False),
        (AgentError(grpc.StatusCode.INVALID_ARGUMENT, "bad"), False),
    ],
)
def test_which_failed_loads_may_be_the_agent_dying(err: AgentError, crash_candidate: bool) -> None:
    assert died_under(err) is crash_candidate


def pod(name: str, restarts: int = 0, uid: str = "", ready: bool = True) -> AgentPod:
    return AgentPod(name=name, namespace="ns", uid=uid or f"uid-{name}", labels={}, ready=ready, endpoint="127.0.0.1:1", restarts=restarts)


GEN1, GEN2 = ("adapter", 1), ("adapter", 2)


def test_two_agent_deaths_during_lone_loads_condemn_the_generation() -> None:
    book = CrashBook(budget=2)
    book.suspect(GEN1, "agent-0", ("uid-agent-0", 0), alone=True, message="Socket closed")
    book.suspect(GEN1, "agent-1", ("uid-agent-1", 0), alone=True, message="Deadline Exceeded")
    assert book.isolate(GEN1) and not book.verdict(GEN1)
    book.observe([pod("agent-0"), pod("agent-1")])  # not restarted (yet): nothing settled
    assert not book.verdict(GEN1) and len(book.suspects[GEN1]) == 2
    book.observe([pod("agent-0", restarts=1), pod("agent-1")])
    assert not book.verdict(GEN1)  # one death: within the budget, tried again (alone)
    book.observe([pod("agent-0", restarts=1), pod("agent-1", ready=False)])  # dead or hung
    verdict = book.verdict(GEN1)
    assert "agent-0" in verdict and "agent-1" in verdict and "Socket closed" in verdict
    assert "until the spec changes" in verdict
    assert not book.verdict(GEN2) and not book.isolate(GEN2)  # a spec change tries again
    # The same agent dying twice (two lives) counts twice: a one-agent fleet is protected too.
    one = CrashBook(budget=2)
    for life in range(2):
        one.suspect(GEN1, "agent-0", ("uid-agent-0", life), alone=True, message="reset")
        one.observe([pod("agent-0", restarts=life + 1)])
    assert one.verdict(GEN1)


def test_network_faults_and_answers_are_not_crashes() -> None:
    book = CrashBook(budget=1)
    # A stall or a partition: the load timed out, the agent never restarted, and a later
    # load on the same life was answered.
    book.suspect(GEN1, "agent-0", ("uid-agent-0", 0), alone=True, message="Deadline Exceeded")
    book.observe([pod("agent-0")])
    book.answered(GEN1, "agent-0", loaded=True)
    book.observe([pod("agent-0", restarts=1)])  # a later, unrelated restart
    assert not book.verdict(GEN1) and not book.isolate(GEN1)
    # A re-created pod (new uid) is not a restart of the one that was loading.
    book.suspect(GEN1, "agent-1", ("uid-agent-1", 0), alone=True, message="reset")
    book.observe([pod("agent-1", uid="new-uid", restarts=0)])
    book.observe([pod("agent-1", uid="new-uid", restarts=3)])
    assert not book.verdict(GEN1)


def test_a_death_with_other_loads_in_flight_isolates_instead_of_counting() -> None:
    book = CrashBook(budget=1)
    for key in (GEN1, ("good", 1)):  # both were loading when agent-0 died
        book.suspect(key, "agent-0", ("uid-agent-0", 0), alone=False, message="reset")
    book.observe([pod("agent-0", restarts=1)])
    assert not book.verdict(GEN1) and not book.verdict(("good", 1))
    assert book.isolate(GEN1) and book.isolate(("good", 1))  # next loads run alone
    book.answered(("good", 1), "agent-0", loaded=True)  # alone it loads: not the culprit
    assert not book.isolate(("good", 1))
    book.suspect(GEN1, "agent-0", ("uid-agent-0", 1), alone=True, message="reset")
    book.observe([pod("agent-0", restarts=2)])
    assert book.verdict(GEN1)
    book.forget("adapter")
    assert not book.verdict(GEN1) and not book.isolate(GEN1)


def test_the_verdict_survives_an_operator_restart_in_the_status() -> None:
    book = CrashBook(budget=2)
    results = [AgentResult("agent-0", AgentState.FAILED, 0, 2, "crashed")]
    stored = build_status(results, generation=1, crashed="generation 1 crashed agent-0")
    ready = stored["conditions"][0]
    assert (stored["phase"], ready["reason"]) == ("Failed", Reason.LOAD_CRASHED_AGENT)
    assert crash_verdict(book, GEN1, stored) == "generation 1 crashed agent-0"
    assert crash_verdict(book, GEN2, stored) == ""  # written for generation 1 only
    assert crash_verdict(book, GEN1, build_status(results, generation=1)) == ""


def test_an_exclusive_load_runs_alone_and_loads_learn_their_overlap() -> None:
    async def scenario() -> list[str]:
        gate, events = LoadGate(), []
        a_started, release_a = asyncio.Event(), asyncio.Event()

        async def load(name: str, exclusive: bool, hold: asyncio.Event | None = None) -> set[str]:
            async with gate.enter(name, exclusive=exclusive) as overlap:
                events.append(f"start {name}")
                if hold is not None:
                    a_started.set()
                    await hold.wait()
                else:
                    await asyncio.sleep(0)
                events.append(f"end {name}")
            return set(overlap)

        first = asyncio.create_task(load("a", False, release_a))
        await a_started.wait()
        suspect = asyncio.create_task(load("suspect", True))
        await asyncio.sleep(0.01)
        late = asyncio.create_task(load("b", False))  # waits behind the exclusive one
        await asyncio.sleep(0.01)
        assert events == ["start a"]
        release_a.set()
        overlaps = await asyncio.gather(first, suspect, late)
        assert overlaps == [set(), set(), set()]
        both = [asyncio.create_task(load(n, False)) for n in ("x", "y")]
        assert await asyncio.gather(*both) == [{"y"}, {"x"}]
        return events

    events = asyncio.run(scenario())
    assert events[:6] == ["start a", "end a", "start suspect", "end suspect", "start b", "end b"]


def test_drift_checks_back_off_while_the_kubernetes_api_fails() -> None:
    settings = Settings(drift_interval_s=30.0, transient_retry_max_s=60.0)
    assert [drift_delay(settings, n) for n in range(4)] == [30, 30, 60, 60]
    fast = Settings(drift_interval_s=1.0, transient_retry_max_s=2.0)
    assert [drift_delay(fast, n) for n in range(4)] == [1, 1, 2, 2]
    assert drift_delay(fast, 1, retry_after_s=7.0) == 7  # the server's Retry-After wins
    throttled = ApiException(status=429, reason="Too Many Requests")
    throttled.headers = {"Retry-After": "3"}
    assert retry_after(throttled) == 3.0
    assert retry_after(ApiException(status=500, reason="x")) == 0.0
    assert retry_after(urllib3.exceptions.ProtocolError("reset")) == 0.0


def test_a_drift_loop_that_finishes_no_round_for_too_long_is_stalled() -> None:
    """Liveness: three of the loop's longest waits plus one load deadline, then it counts as
    wedged (the probe fails and the kubelet restarts the operator)."""
    settings = Settings(drift_interval_s=30, transient_retry_max_s=60, load_deadline_s=120)
    assert loop_stall_s(settings) == 300
    beats = {("ns", "a"): 1000.0, ("ns", "b"): 1250.0}
    assert stalled_loops(beats, 1300.0, settings) == []
    assert stalled_loops(beats, 1300.5, settings) == ["ns/a"]
    assert stalled_loops(beats, 2000.0, settings) == ["ns/a", "ns/b"]


def test_kopfs_own_api_requests_retry_without_giving_up() -> None:
    backoffs = kopf_api_backoffs(SETTINGS)
    first = [b for _, b in zip(range(8), backoffs, strict=False)]
    assert first == [2, 4, 8, 16, 32, 60, 60, 60]
    assert [b for _, b in zip(range(3), backoffs, strict=False)] == [2, 4, 8]  # fresh per request
    assert not hasattr(backoffs, "__len__")  # kopf then counts attempts without a last one


@pytest.mark.parametrize(("raw", "token"), [(b"tok\n", "tok"), (b"  tok \r\n", "tok"), (b"a-b_c.d~e+f/g=", "a-b_c.d~e+f/g=")])
def test_bearer_token_is_trimmed(raw: bytes, token: str) -> None:
    assert bearer_token(raw) == token


@pytest.mark.parametrize("raw", [b"ab\x07cd", b"ab\ncd", b"ab\x00", b"t\xc3\xa9", b"\n", b""])
def test_a_token_that_is_no_header_value_is_refused_permanently(raw: bytes) -> None:
    with pytest.raises(FleetProblem) as err:
        bearer_token(raw)
    assert isinstance(err.value, Permanent)
    assert err.value.reason == Reason.INVALID_TOKEN
    assert "ab" not in err.value.message  # never the value


def test_a_secret_is_used_only_when_opened_to_the_fleet() -> None:
    assert opened_to(SecretData(labels={ALLOW_LABEL: "true"}), "f")
    assert opened_to(SecretData(labels={ALLOW_LABEL: "f"}), "f")
    assert not opened_to(SecretData(labels={ALLOW_LABEL: "g"}), "f")
    assert opened_to(SecretData(annotations={ALLOW_ANNOTATION: "g, f"}), "f")
    assert not opened_to(SecretData(annotations={ALLOW_ANNOTATION: "g,ff"}), "f")
    assert not opened_to(SecretData(labels={ALLOW_LABEL: "false"}), "f")
    assert not opened_to(SecretData(), "f")


@pytest.mark.parametrize(
    ("status", "refused"),
    [(400, True), (403, True), (404, True), (422, True), (408, False), (409, False), (429, False), (500, False), (503, False)],
)
def test_a_4xx_is_the_asking_objects_permanent_error_and_the_rest_transient(status: int, refused: bool) -> None:
    """A client error (other than a timeout, conflict or throttling) would be refused again;
    a server error or a lost connection may pass."""
    assert kube_refused(ApiException(status=status, reason="x")) is refused
    assert not kube_refused(urllib3.exceptions.ProtocolError("connection reset"))


def test_a_secret_read_the_api_server_refuses_is_that_adapters_refusal() -> None:
    """A 400 on a Secret's read (a name the API server cannot take) refuses the adapter with
    the one message naming the Secret; a 503 escapes as transient."""

    class Refusing(Kube):
        def __init__(self, status: int) -> None:  # no API client: every read is refused
            self.status = status

        async def get_secret(self, namespace: str, name: str) -> SecretData:
            raise ApiException(status=self.status, reason="x")

    with pytest.raises(FleetProblem) as refused:
        asyncio.run(opened_secret(Refusing(400), "ns", "fleet", "creds-b%2Fbob", ("token",)))
    assert refused.value.reason == Reason.SECRET_NOT_OPENED and "'creds-b%2Fbob'" in refused.value.message
    with pytest.raises(ApiException):
        asyncio.run(opened_secret(Refusing(503), "ns", "fleet", "creds", ("token",)))
