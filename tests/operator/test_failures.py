"""The failure and retry policy (lorafleet_operator.failures) as plain decisions: which failures
are transient, the back-off delays, the deletion budget, the drift check's slow retries, what a
load's outcome means for the handler — and the settings it reads, from the environment."""

from __future__ import annotations

import grpc
import pytest
import urllib3
from kubernetes.client.exceptions import ApiException

from lorafleet_operator.agent_client import AgentError, ControlReply
from lorafleet_operator.config import ENV_VARS, Settings
from lorafleet_operator.failures import (
    KUBE_API_ERRORS,
    Permanent,
    SlowRetries,
    Transient,
    agent_state,
    backoff,
    check_load,
    delete_waits,
    failed_delay,
    is_transient,
    transient_delay,
)
from lorafleet_operator.status import AgentResult, AgentState, Phase

REFUSED = ControlReply(success=False, error_message="sha256 mismatch", ranks_ok=0,
                       ranks_reported=2)
DOWN = AgentError(grpc.StatusCode.UNAVAILABLE, "connection refused")
SETTINGS = Settings(transient_retry_s=2.0, transient_retry_max_s=60.0, failed_retry_s=300.0,
                    failed_retry_max_s=3600.0, delete_retries=5)


@pytest.mark.parametrize("code", [
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED,
])
def test_busy_or_down_agents_are_transient(code: grpc.StatusCode) -> None:
    assert is_transient(AgentError(code, "x"))
    assert agent_state(AgentError(code, "x")) is AgentState.UNREACHABLE


@pytest.mark.parametrize("code", [
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
])
def test_other_codes_and_refusals_are_permanent(code: grpc.StatusCode) -> None:
    assert not is_transient(AgentError(code, "x"))
    assert agent_state(AgentError(code, "x")) is AgentState.FAILED
    # An agent that answered success=false refused: the same request would be refused again.
    assert not is_transient(REFUSED)
    assert agent_state(REFUSED) is AgentState.FAILED


def test_kubernetes_api_errors_are_the_clients_own() -> None:
    assert isinstance(ApiException(status=503, reason="Service Unavailable"), KUBE_API_ERRORS)
    assert isinstance(urllib3.exceptions.ProtocolError("connection reset"), KUBE_API_ERRORS)


def test_backoff_doubles_from_the_first_delay_up_to_the_cap() -> None:
    assert [backoff(2.0, 60.0, n) for n in range(7)] == [2, 4, 8, 16, 32, 60, 60]
    assert backoff(2.0, 60.0, 10_000) == 60  # no overflow for long-failing handlers
    assert [transient_delay(SETTINGS, n) for n in (0, 1, 5)] == [2, 4, 60]
    # The drift check counts attempts from 1: the first failure waits the first delay.
    assert [failed_delay(SETTINGS, n) for n in (1, 2, 3, 4, 5, 6)] == \
        [300, 600, 1200, 2400, 3600, 3600]


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


def test_slow_retries_back_off_per_generation_and_agent() -> None:
    clock = Clock()
    book = SlowRetries(SETTINGS, clock=clock)
    key, other_agent, next_generation = ("uid", 1, "agent-1"), ("uid", 1, "agent-0"), \
        ("uid", 2, "agent-1")
    assert book.waiting(key) is None  # never failed: due at once
    book.record(key, "sha256 mismatch")
    failure = book.waiting(key)
    assert failure is not None and (failure.attempts, failure.message) == (1, "sha256 mismatch")
    assert book.waiting(other_agent) is None and book.waiting(next_generation) is None
    clock.now += 299
    assert book.waiting(key) is not None
    clock.now += 1
    assert book.waiting(key) is None  # 300 s passed: the drift check may try once more
    book.record(key, "sha256 mismatch")
    clock.now += 599
    assert book.waiting(key) is not None  # the second failure waits twice as long
    clock.now += 1
    assert book.waiting(key) is None


def test_slow_retries_forget_successes_and_deleted_adapters() -> None:
    book = SlowRetries(SETTINGS, clock=Clock())
    book.remember(("a", 1, "agent-0"), AgentResult("agent-0", AgentState.FAILED, 0, 2, "bad"))
    book.remember(("a", 1, "agent-1"), AgentResult("agent-1", AgentState.FAILED, 0, 2, "bad"))
    book.remember(("b", 1, "agent-0"), AgentResult("agent-0", AgentState.FAILED, 0, 2, "bad"))
    assert book.waiting(("a", 1, "agent-0")) is not None
    book.remember(("a", 1, "agent-0"), AgentResult("agent-0", AgentState.LOADED, 2, 2))
    assert book.waiting(("a", 1, "agent-0")) is None
    # Unreachable is not a refusal: nothing to back off slowly (kopf retries it soon).
    book.remember(("a", 1, "agent-1"), AgentResult("agent-1", AgentState.UNREACHABLE, 0, 2, "x"))
    assert book.waiting(("a", 1, "agent-1")) is None
    book.clear_adapter("b")
    assert not book.entries


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
        check_load([AgentResult("agent-0", AgentState.FAILED, 0, 2, "sha256 mismatch"), FAILED],
                   Phase.FAILED, "sha256 mismatch")


def test_settings_from_the_environment_default_to_the_fields_defaults() -> None:
    assert Settings.from_env({}) == Settings(namespaces=("default",),
                                             identity=Settings.from_env({}).identity)
    env = {"LORAFLEET_DRIFT_INTERVAL_SECONDS": "1.5", "LORAFLEET_DELETE_RETRIES": "2",
           "LORAFLEET_WATCH_NAMESPACES": "a, b,", "LORAFLEET_LEASE_NAMESPACE": "ops",
           "POD_NAME": "op-0", "LORAFLEET_LEASE_NAME": " "}
    settings = Settings.from_env(env)
    assert (settings.drift_interval_s, settings.delete_retries) == (1.5, 2)
    assert (settings.namespaces, settings.lease_namespace, settings.identity) == \
        (("a", "b"), "ops", "op-0")
    assert settings.lease_name == "lorafleet-operator"  # blank means unset
    assert Settings.from_env({"LORAFLEET_LEASE_NAMESPACE": "ops"}).namespaces == ("ops",)
    # Every setting has its variable (docs/operator.md lists them).
    assert set(ENV_VARS) == set(Settings.__dataclass_fields__)
