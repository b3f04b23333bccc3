"""Scaling by demand's own rules (operator/lorafleet_operator/scaling.py, standby.py) as plain
values: the demand summed over agents (unknown, never zero, when one that may hold the adapter
did not answer), the slots demand-scaled adapters share, ``spec.scaling`` read with its
defaults, ``status.scaling``; what a standby adapter's agents hold that is kept as it is, and
which standby pods are routed."""

from __future__ import annotations

import math

import grpc
import pytest

from lorafleet.v1 import agent_pb2
from lorafleet_common.registry import RegistryEntry
from lorafleet_operator.agent_client import control_reply
from lorafleet_operator.agent_values import AdapterDemand, AgentDemand, AgentError, AgentInfo, Credentials
from lorafleet_operator.demand import ScalingReason, ScalingState
from lorafleet_operator.fleet import AgentPod
from lorafleet_operator.resources import AdapterObject, AdapterSpec, FleetSpec, ScalingMetric, ScalingSpec, Source, scaling_spec_of
from lorafleet_operator.routing import routed_pods
from lorafleet_operator.scaling import Scaled, decide_one, demand_of, policy_of, scaling_status, slots_for
from lorafleet_operator.sending import loaded_result
from lorafleet_operator.standby import as_held, loadable
from lorafleet_operator.status import AgentResult, AgentState
from lorafleet_operator.view import FleetView, Target

NAME = "ns.hot"


def entry(name: str) -> RegistryEntry:
    return RegistryEntry(name=name, source_uri="file:///a", sha256="", pinned=False, ranks=(0,))


def sample(**demands: tuple[int, int, float]) -> AgentDemand:
    adapters = {n.replace("_", "."): AdapterDemand(n.replace("_", "."), r, w, 0, t, 0, 0.0, 0.0) for n, (r, w, t) in demands.items()}
    return AgentDemand(0.0, 60.0, adapters)


DOWN = AgentError(grpc.StatusCode.UNAVAILABLE, "connection refused")


def test_demand_is_summed_and_unknown_when_a_holder_does_not_answer() -> None:
    registries = {"a": {NAME: entry(NAME)}, "b": {}, "c": {NAME: entry(NAME)}}
    samples = {"a": sample(ns_hot=(2, 1, 10.0)), "b": sample(), "c": sample(ns_hot=(1, 0, 5.5))}
    assert demand_of(NAME, ScalingMetric.REQUESTS, samples, registries) == 4
    assert demand_of(NAME, ScalingMetric.TOKENS_PER_SECOND, samples, registries) == 15.5
    # An agent that does not hold it and did not answer: its demand for it is none.
    assert demand_of(NAME, ScalingMetric.REQUESTS, {**samples, "b": DOWN}, registries) == 3 + 0 + 1
    # One that holds it, or whose registry is unknown: the demand is unknown, not lower.
    assert demand_of(NAME, ScalingMetric.REQUESTS, {**samples, "c": DOWN}, registries) is None
    assert demand_of(NAME, ScalingMetric.REQUESTS, {**samples, "b": DOWN}, {**registries, "b": DOWN}) is None


def info(base_model: str = "m", cap: int = 4) -> AgentInfo:
    return AgentInfo(base_model, 1, 1, 1, 1, 1, 16, 4, cap)


def test_the_slots_scaled_adapters_share() -> None:
    pods = tuple(AgentPod(n, "ns", n, {}, True, f"127.0.0.1:{i}", 0) for i, n in enumerate("abcd"))
    view = FleetView("ns", pods, {"a": info(), "b": info(cap=2), "c": info("other"), "d": DOWN}, Credentials())
    registries = {"a": {NAME: entry(NAME), "ns.fixed": entry("ns.fixed")}, "b": {}, "c": {}, "d": {}}
    # a: 4 less the one name not scaled; b: 2; c serves another model; d did not answer.
    assert slots_for(view, registries, "m", frozenset({NAME})) == 3 + 2


def adapter(scaling: ScalingSpec, uid: str = "u1") -> AdapterObject:
    return AdapterObject("ns", "hot", AdapterSpec("f", "m", Source("file:///a"), scaling=scaling), uid=uid)


def test_spec_defaults_policy_and_the_status() -> None:
    spec = scaling_spec_of({"maxReplicas": 3, "target": {"perReplica": 2}})
    assert spec == ScalingSpec(1, 3, ScalingMetric.REQUESTS, 2.0, 300, 4, 15)
    policy = policy_of(spec)
    assert (policy.min_replicas, policy.max_replicas, policy.scale_down_window_s) == (1, 3, 300.0)
    one = Scaled(adapter(spec), spec)
    book, decided = decide_one(one, None, 5.0, 1, 0.0)  # ceil(5 / 2) = 3, the limit allows +4
    assert (book.desired, decided.decision and decided.decision.reason) == (3, ScalingReason.SCALED_UP)
    status = scaling_status(decided, book, {})
    assert status["desiredReplicas"] == 3 and status["demand"] == "5" and status["currentReplicas"] == 1
    assert (status["lastDecision"]["from"], status["lastDecision"]["to"], status["lastDecision"]["reason"]) == (1, 3, "ScaledUp")
    # Demand unknown: nothing decided, the replicas kept, the last decision kept.
    kept, unknown = decide_one(one, book, None, 3, 1.0)
    assert kept == book and unknown.decision is None
    again = scaling_status(unknown, kept, status)
    assert again["demand"] == "unknown" and again["lastDecision"] == status["lastDecision"]
    # A spec the CRD would refuse (min above max) decides nothing, alone.
    bad = ScalingSpec(3, 2, ScalingMetric.REQUESTS, 1.0)
    assert decide_one(Scaled(adapter(bad), bad), None, 5.0, 0, 0.0)[1].decision is None
    # A new object of the same name starts afresh, at its minimum.
    fresh, _ = decide_one(Scaled(adapter(spec, uid="u2"), spec), book, 0.0, 0, 2.0)
    assert fresh.uid == "u2" and fresh.desired == 1 and fresh.state != ScalingState()


def test_demand_is_smoothed_over_the_spec_s_time_constant() -> None:
    """A burst moves the average by a share that depends on the time since the last sample,
    not on how often samples come; 0 takes each sample as it is (the HPA's way)."""
    spec = scaling_spec_of({"maxReplicas": 8, "target": {"perReplica": 1}, "behavior": {"demandSmoothingSeconds": 100}})
    assert spec.smoothing_s == 100 and scaling_spec_of({"maxReplicas": 1, "target": {"perReplica": 1}}).smoothing_s == 150
    one = Scaled(adapter(spec), spec)
    first, _ = decide_one(one, None, 0.0, 1, 0.0)  # the first sample is taken as it is
    assert (first.demand, first.sampled_at) == (0.0, 0.0)
    burst, decided = decide_one(one, first, 8.0, 1, 100.0)  # one time constant later: 1 - 1/e of the step
    assert burst.demand == pytest.approx(8.0 * (1 - math.exp(-1)))
    assert decided.decision is not None and decided.decision.demand == pytest.approx(burst.demand)
    assert decided.decision.recommended == 6 and burst.desired == 5  # ceil(5.06 / 1), not the burst's 8; +4 at most
    same_time, _ = decide_one(one, burst, 0.0, 6, 100.0)  # no time passed: the past stands
    assert same_time.demand == burst.demand
    raw = ScalingSpec(1, 8, ScalingMetric.REQUESTS, 1.0, smoothing_s=0)
    assert decide_one(Scaled(adapter(raw), raw), first, 8.0, 1, 100.0)[0].demand == 8.0


# ---- standby -----------------------------------------------------------------------------


def standby_adapter(placed: tuple[str, ...] = ()) -> AdapterObject:
    spec = ScalingSpec(0, 2, ScalingMetric.REQUESTS, 1.0)
    body = adapter(spec)
    return body.with_status({"placement": {"placed": list(placed)}})


def on(pod: str, *, standby: bool) -> Target:
    return Target(AgentPod(pod, "ns", pod, {}, True, "10.0.0.1:1", 0, "10.0.0.1", (("grpc", 1),)), info(), standby=standby)


def registry_entry(*, standby: bool, pinned: bool = False, name: str = NAME) -> RegistryEntry:
    return RegistryEntry(name, "file:///a", "", pinned, () if standby else (0,), standby=standby)


def test_what_a_standby_adapter_s_agents_hold_is_kept_as_it_is() -> None:
    on_standby, resident = registry_entry(standby=True), registry_entry(standby=False)
    registry = {NAME: on_standby}
    # Wanted on standby: standby or resident (loaded by its first request) are both kept.
    assert as_held(on("a", standby=True), on_standby, standby_adapter(), registry) == AgentResult("a", AgentState.STANDBY, 0, 1)
    assert as_held(on("a", standby=True), resident, standby_adapter(), {NAME: resident}) == AgentResult("a", AgentState.LOADED, 1, 1)
    # Placed resident: a standby entry is kept where it was placed before (the agent put it
    # back on standby), loaded where the place is new.
    assert as_held(on("a", standby=False), on_standby, standby_adapter(("a",)), registry) is not None
    assert as_held(on("a", standby=False), on_standby, standby_adapter(), registry) is None
    # Resident where it was placed and is now wanted on standby: a scale-down, so a load is due.
    assert as_held(on("a", standby=True), resident, standby_adapter(("a",)), {NAME: resident}) is None


def test_a_standby_pod_is_routed_only_with_room_to_load() -> None:
    pinned = {f"ns.p{i}": registry_entry(standby=False, pinned=True, name=f"ns.p{i}") for i in range(4)}
    assert loadable(info(cap=4), {NAME: registry_entry(standby=True)})
    assert not loadable(info(cap=4), {**pinned, NAME: registry_entry(standby=True)})  # every slot pinned
    assert loadable(info(cap=4), {**pinned, "ns.p0": registry_entry(standby=False, name="ns.p0")})  # one evictable
    pods = [on(p, standby=True).agent for p in ("a", "b", "c")]
    results = [
        AgentResult("a", AgentState.STANDBY, 0, 2),
        AgentResult("b", AgentState.STANDBY, 0, 2, loadable=False),
        AgentResult("c", AgentState.LOADED, 2, 2),
    ]
    assert [p.pod for p in routed_pods(FleetSpec(), pods, results)] == ["a", "c"]


def test_a_standby_load_the_agent_answers_resident_is_loaded_in_status() -> None:
    """A standby load that finds the adapter resident (a request loaded it, or still leases it:
    its return to standby waits) says so (LoadAdapterResponse.residency), and the status says
    Loaded on its ranks, not Standby; an agent that says nothing (older) is taken at its word."""

    def answered(residency: int) -> AgentResult:
        rank = agent_pb2.RankResult(success=True)
        reply = agent_pb2.LoadAdapterResponse(success=True, rank_results=[rank], residency=residency)
        return loaded_result(on("a", standby=True), control_reply(reply, "file:///a"))

    assert answered(agent_pb2.ADAPTER_RESIDENCY_RESIDENT) == AgentResult("a", AgentState.LOADED, 1, 1)
    assert answered(agent_pb2.ADAPTER_RESIDENCY_STANDBY) == AgentResult("a", AgentState.STANDBY, 0, 1)
    assert answered(agent_pb2.ADAPTER_RESIDENCY_UNSPECIFIED) == AgentResult("a", AgentState.STANDBY, 0, 1)
    resident_target = loaded_result(on("a", standby=False), control_reply(agent_pb2.LoadAdapterResponse(success=True), "file:///a"))
    assert resident_target.state is AgentState.LOADED
