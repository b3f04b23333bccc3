"""Demand-driven replicas (operator/lorafleet_operator/demand.py) and their placement
(demand_placement.py): the rules as plain decisions, no cluster."""

from __future__ import annotations

import math
import random

import pytest

from lorafleet_operator.demand import (
    LimitKind,
    Recommendation,
    ScaleUpLimit,
    ScalingPolicy,
    ScalingReason,
    ScalingState,
    decide,
    recommend,
    smooth,
    smoothing_weight,
)
from lorafleet_operator.demand_placement import (
    AdapterNeed,
    DemandPlacement,
    Move,
    PlacementReason,
    PlacementTuning,
    SlotAgent,
    place_by_demand,
    rendezvous_order,
)
from lorafleet_operator.placement import Candidate

UNLIMITED = ScalingPolicy(1, 10, 4.0, scale_down_window_s=60.0, scale_up_limits=())


# ---- replicas from demand -----------------------------------------------------------------


def test_desired_replicas_follow_demand_within_bounds() -> None:
    policy = ScalingPolicy(1, 5, 4.0)
    assert [recommend(policy, d) for d in (0, 0.1, 4, 4.01, 9, 1000)] == [1, 1, 1, 2, 3, 5]
    assert recommend(ScalingPolicy(0, 5, 4.0), 0) == 0
    state, current = ScalingState(), 1
    for now, demand in enumerate((4.0, 8.0, 12.0, 20.0)):
        decision, state = decide("a", UNLIMITED, state, current, demand, float(now))
        assert decision.to_replicas == math.ceil(demand / 4)
        current = decision.to_replicas
    assert decision.reason is ScalingReason.SCALED_UP and decision.from_replicas == 3


def test_the_window_holds_a_dip_shorter_than_it_and_releases_after() -> None:
    state, current, seen = ScalingState(), 4, []
    for now, demand in [(0, 16.0), (10, 4.0), (30, 4.0), (40, 16.0), (50, 4.0), (99, 4.0), (100, 4.0), (110, 4.0)]:
        decision, state = decide("a", UNLIMITED, state, current, demand, float(now))
        current = decision.to_replicas
        seen.append((now, current, decision.reason))
    assert seen == [
        (0, 4, ScalingReason.STEADY),
        (10, 4, ScalingReason.HELD),  # the dip: 1 recommended, 4 held
        (30, 4, ScalingReason.HELD),
        (40, 4, ScalingReason.STEADY),
        (50, 4, ScalingReason.HELD),
        (99, 4, ScalingReason.HELD),  # the last 4 was recommended at 40: held until 100
        (100, 1, ScalingReason.SCALED_DOWN),
        (110, 1, ScalingReason.STEADY),
    ]
    held = decide("a", UNLIMITED, ScalingState((Recommendation(0.0, 4),)), 4, 4.0, 30.0)[0]
    assert held.message == "demand 4 at 4 per replica recommends 1: 4 → 4, held by the scale-down window (60 s)"


def test_the_rate_limit_caps_scale_up_per_period() -> None:
    two_per_30s = ScalingPolicy(1, 20, 1.0, scale_up_limits=(ScaleUpLimit(LimitKind.REPLICAS, 2, 30.0),))
    state, current, seen = ScalingState(), 1, []
    for now in (0, 10, 29, 30, 45, 60):
        decision, state = decide("a", two_per_30s, state, current, 20.0, float(now))
        current = decision.to_replicas
        seen.append((now, current, decision.reason))
    assert seen == [
        (0, 3, ScalingReason.RATE_LIMITED),
        (10, 3, ScalingReason.RATE_LIMITED),
        (29, 3, ScalingReason.RATE_LIMITED),
        (30, 5, ScalingReason.RATE_LIMITED),
        (45, 5, ScalingReason.RATE_LIMITED),
        (60, 7, ScalingReason.RATE_LIMITED),
    ]
    # Several limits: the most permissive applies (the HPA's selectPolicy Max).
    both = ScalingPolicy(
        1, 20, 1.0, scale_up_limits=(ScaleUpLimit(LimitKind.REPLICAS, 2, 30.0), ScaleUpLimit(LimitKind.PERCENT, 300, 30.0))
    )
    assert decide("a", both, ScalingState(), 2, 20.0, 0.0)[0].to_replicas == 8
    # A percentage of zero is zero: the HPA's defaults start from zero with their 4 replicas.
    percent = ScalingPolicy(0, 20, 1.0, scale_up_limits=(ScaleUpLimit(LimitKind.PERCENT, 100, 15.0),))
    assert decide("a", percent, ScalingState(), 0, 20.0, 0.0)[0].to_replicas == 0
    assert decide("a", ScalingPolicy(0, 20, 1.0), ScalingState(), 0, 20.0, 0.0)[0].to_replicas == 4


def test_smoothing_and_bad_inputs() -> None:
    assert smooth(None, 8.0, 0.5) == 8.0
    assert smooth(8.0, 0.0, 0.25) == 6.0
    assert smoothing_weight(3.0, 3.0) == pytest.approx(1 - math.exp(-1))
    for bad in (
        lambda: ScalingPolicy(3, 2, 1.0),
        lambda: ScalingPolicy(0, 0, 1.0),
        lambda: ScalingPolicy(0, 2, 0.0),
        lambda: ScalingPolicy(0, 2, 1.0, scale_down_window_s=-1),
        lambda: ScaleUpLimit(LimitKind.REPLICAS, 0, 15.0),
        lambda: recommend(UNLIMITED, math.nan),
        lambda: smooth(1.0, -1.0, 0.5),
        lambda: smooth(1.0, 1.0, 0.0),
        lambda: decide("a", UNLIMITED, ScalingState(), -1, 1.0, 0.0),
        lambda: PlacementTuning(0.5),
    ):
        with pytest.raises(ValueError):
            bad()


# ---- placement ----------------------------------------------------------------------------


def agent(
    pod: str, held: set[str] | None = None, *, cap: int = 4, rank: int = 64, model: str = "m", pinned: frozenset[str] = frozenset()
) -> SlotAgent:
    candidate = Candidate(pod, pod, True, base_model=model, max_lora_rank=rank, max_loaded_loras=cap, held=frozenset(held or ()))
    return SlotAgent(candidate, pinned)


def need(name: str, demand: float = 1.0, *, replicas: int = 1, minimum: int = 0, rank: int | None = None, model: str = "m") -> AdapterNeed:
    return AdapterNeed(name, model, rank, demand, minimum, replicas)


def held_after(agents: list[SlotAgent], result: DemandPlacement, extra: tuple[SlotAgent, ...] = ()) -> list[SlotAgent]:
    """The agents as they are once the placement's loads and unloads are done (plus new ones)."""
    out = []
    for a in [*agents, *extra]:
        unmanaged = {n for n in a.candidate.held if n not in result.placed}
        mine = {n for n, pods in result.placed.items() if a.pod in pods}
        out.append(
            agent(
                a.pod,
                unmanaged | mine,
                cap=a.candidate.max_loaded_loras,
                rank=a.candidate.max_lora_rank,
                model=a.candidate.base_model,
                pinned=a.pinned,
            )
        )
    return out


def test_new_replicas_go_by_rendezvous_and_unchanged_demand_moves_nothing() -> None:
    agents = [agent(f"p{i}") for i in range(6)]
    needs = [need(f"n{i}", demand=10 - i, replicas=1 + i % 3) for i in range(8)]
    first = place_by_demand(agents, needs)
    assert first.placed["n0"] == (rendezvous_order("n0", [a.pod for a in agents])[0],)
    assert set(first.placed["n2"]) == set(rendezvous_order("n2", [a.pod for a in agents])[:3])
    assert len(first.loads) == sum(n.replicas for n in needs) and not first.unloads
    again = place_by_demand(held_after(agents, first), needs)
    assert again.placed == first.placed
    assert not again.loads and not again.unloads
    assert {d.reason for d in again.decisions} == {PlacementReason.KEPT}


def test_a_new_agent_moves_no_adapter() -> None:
    agents = [agent(f"p{i}") for i in range(3)]
    needs = [need(f"n{i}", demand=5, replicas=2) for i in range(4)]
    first = place_by_demand(agents, needs)
    # The new agents rank first for some adapters: rendezvous alone would move those.
    newcomers = (agent("q0"), agent("q1"), agent("q2"))
    assert any(rendezvous_order(n.name, ["q0", "q1", "q2", *first.placed[n.name]])[0].startswith("q") for n in needs)
    after = place_by_demand(held_after(agents, first, newcomers), needs)
    assert after.placed == first.placed and not after.loads and not after.unloads
    # A scale-up then uses the room the new agents brought.
    grown = place_by_demand(held_after(agents, first, newcomers), [*needs[:3], need("n3", demand=5, replicas=4)])
    assert set(first.placed["n3"]) < set(grown.placed["n3"]) and not grown.unloads


def test_capacity_slots_rank_base_model_and_pinned_slots() -> None:
    agents = [
        agent("full", {"hand-loaded", "other-namespace"}, cap=2),
        agent("small-rank", rank=8),
        agent("other-model", model="x"),
        agent("pinned", {"p"}, cap=2, pinned=frozenset({"p"})),
        agent("roomy", cap=2),
    ]
    needs = [need("big", demand=9, rank=64, replicas=5), need("p", demand=0.01, replicas=0), need("small", demand=8, rank=8, replicas=5)]
    got = place_by_demand(agents, needs)
    assert set(got.placed["big"]) <= {"pinned", "roomy"} and got.placed["big"]  # rank 64: not small-rank
    assert "small-rank" in got.placed["small"] and got.placed["p"] == ("pinned",)
    assert not {"full", "other-model"} & {pod for pods in got.placed.values() for pod in pods}
    for a in agents:
        slots = len(set(a.candidate.held) - set(got.placed)) + sum(a.pod in pods for pods in got.placed.values())
        assert slots <= a.candidate.max_loaded_loras, a.pod
    decisions = {d.adapter: d for d in got.decisions}
    assert decisions["big"].reason is PlacementReason.NO_ROOM and decisions["big"].to_replicas < 5
    assert decisions["p"].reason is PlacementReason.KEPT  # pinned: kept though 0 replicas are wanted
    nowhere = place_by_demand(agents, [need("alien", model="y")])
    assert nowhere.placed["alien"] == () and nowhere.decisions[0].reason is PlacementReason.NO_FIT


def test_priority_under_scarcity_evicts_the_least_demand_per_replica() -> None:
    agents = [agent("a", cap=1), agent("b", cap=1)]
    got = place_by_demand(agents, [need("hot", 10), need("warm", 5), need("cold", 1)])
    assert sorted(n for n, pods in got.placed.items() if pods) == ["hot", "warm"]
    assert {d.adapter: d.reason for d in got.decisions}["cold"] is PlacementReason.NO_ROOM
    # Held by warm and cold, a hot newcomer takes cold's slot, not warm's.
    held = [agent("a", {"warm"}, cap=1), agent("b", {"cold"}, cap=1)]
    got = place_by_demand(held, [need("hot", 20), need("warm", 5), need("cold", 1)])
    assert got.loads == (Move("hot", "b"),) and got.unloads == (Move("cold", "b"),)
    evicted = {d.adapter: d for d in got.decisions}["cold"]
    assert (evicted.reason, evicted.from_replicas, evicted.to_replicas) == (PlacementReason.EVICTED, 1, 0)
    assert "hot" in evicted.message
    # Within the margin (2×), nothing moves: 1.9 per replica does not evict 1.
    assert not place_by_demand(held, [need("near", 1.9), need("warm", 5), need("cold", 1)]).unloads
    assert place_by_demand(held, [need("near", 2.1), need("warm", 5), need("cold", 1)]).unloads == (Move("cold", "b"),)
    assert not place_by_demand(held, [need("near", 2.1), need("warm", 5), need("cold", 1)], PlacementTuning(3.0)).unloads


def test_minimum_replicas_are_never_evicted_unless_capacity_forces_it() -> None:
    held = [agent("a", {"floor"}, cap=1), agent("b", {"cheap"}, cap=1)]
    needs = [need("floor", 0.1, minimum=1), need("cheap", 1), need("hot", 10)]
    got = place_by_demand(held, needs)
    assert got.unloads == (Move("cheap", "b"),)  # cheap, worth more than floor, but above its minimum
    # A newcomer below its own minimum evicts whatever is above its minimum, whatever its worth.
    got = place_by_demand(held, [need("floor", 0.1, minimum=1), need("cheap", 1000), need("must", 0.01, minimum=1)])
    assert got.unloads == (Move("cheap", "b"),) and got.loads == (Move("must", "b"),)
    # Nothing above its minimum: the newcomer waits, and says why.
    got = place_by_demand(held, [need("floor", 0.1, minimum=1), need("cheap", 1, minimum=1), need("hot", 10)])
    assert not got.unloads and {d.adapter: d.reason for d in got.decisions}["hot"] is PlacementReason.NO_ROOM
    # An agent that shrank below what it holds sheds a replica under its minimum, and says so.
    shrunk = [agent("a", {"floor", "cheap"}, cap=1)]
    got = place_by_demand(shrunk, [need("floor", 0.1, minimum=1), need("cheap", 1, minimum=1)])
    assert got.unloads == (Move("floor", "a"),)
    decision = {d.adapter: d for d in got.decisions}["floor"]
    assert decision.reason is PlacementReason.BELOW_MINIMUM and "capacity forces it" in decision.message


def run_loop(demands: list[float], policy: ScalingPolicy) -> int:
    """Decide and place every 10 s over a 4-agent fleet; the loads it took."""
    agents = [agent(f"p{i}") for i in range(4)]
    state, desired, loads = ScalingState(), 0, 0
    for step, demand in enumerate(demands):
        decision, state = decide("osc", policy, state, desired, demand, step * 10.0)
        desired = decision.to_replicas
        result = place_by_demand(agents, [need("osc", demand, replicas=desired)])
        loads += len(result.loads)
        agents = held_after(agents, result)
    return loads


def test_oscillating_demand_takes_a_bounded_number_of_loads() -> None:
    oscillating = [16.0 if (step // 3) % 2 == 0 else 2.0 for step in range(120)]  # 30 s high, 30 s low, 20 minutes
    policy = ScalingPolicy(0, 4, 4.0, scale_down_window_s=300.0)
    assert run_loop(oscillating, policy) == 4  # 4 replicas once, held through every dip
    flapping = run_loop(oscillating, ScalingPolicy(0, 4, 4.0, scale_down_window_s=0.0))
    assert flapping >= 3 * 19  # without the window: 3 loads at every one of the 19 rises after the first


def test_placement_is_deterministic_whatever_the_input_order() -> None:
    rng = random.Random(7)
    agents = [agent(f"p{i}", {f"n{j}" for j in range(12) if rng.random() < 0.2} | {"fixed"}, cap=5) for i in range(6)]
    needs = [need(f"n{j}", rng.uniform(0, 20), replicas=rng.randint(0, 3), minimum=rng.randint(0, 1)) for j in range(12)]
    first = place_by_demand(agents, needs)
    for _ in range(5):
        rng.shuffle(agents)
        rng.shuffle(needs)
        assert place_by_demand(agents, needs) == first
    with pytest.raises(ValueError, match="once"):
        place_by_demand(agents, [*needs, needs[0]])
