"""Demand-driven replicas (operator/lorafleet_operator/demand.py): desired replicas and the
slots shared by demand, as plain decisions, no cluster."""

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
    SlotClaim,
    decide,
    recommend,
    share_slots,
    smooth,
    smoothing_weight,
)

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
    ):
        with pytest.raises(ValueError):
            bad()


# ---- slots shared by demand ---------------------------------------------------------------


def claim(name: str, demand: float, *, desired: int = 1, current: int = 0, minimum: int = 0) -> SlotClaim:
    return SlotClaim(name, demand, desired, current, minimum)


def test_scarce_slots_go_by_demand_per_replica() -> None:
    claims = [claim("hot", 10, desired=3), claim("warm", 5), claim("cold", 1)]
    # hot's replicas are worth 10, 5, 3.3; warm's 5; cold's 1.
    assert share_slots(claims, 3) == {"hot": 2, "warm": 1, "cold": 0}
    assert share_slots(claims, 10) == {"hot": 3, "warm": 1, "cold": 1}
    assert share_slots(claims, 0) == {"hot": 0, "warm": 0, "cold": 0}


def test_a_held_replica_keeps_its_slot_within_the_margin() -> None:
    held = [claim("warm", 5, current=1), claim("cold", 1, current=1)]
    # A newcomer worth 2.4 does not take cold's slot (1 × the default margin 2.5); one worth 2.6 does.
    assert share_slots([*held, claim("near", 2.4)], 2) == {"warm": 1, "cold": 1, "near": 0}
    assert share_slots([*held, claim("near", 2.6)], 2) == {"warm": 1, "cold": 0, "near": 1}
    assert share_slots([*held, claim("near", 2.6)], 2, margin=3.0)["near"] == 0


def test_minimums_come_first_and_the_order_does_not_matter() -> None:
    claims = [claim("floor", 0.1, minimum=1), claim("cheap", 1000, current=1), claim("must", 0.01, minimum=1)]
    assert share_slots(claims, 2) == {"floor": 1, "cheap": 0, "must": 1}
    rng = random.Random(7)
    many = [claim(f"n{j}", rng.uniform(0, 20), desired=rng.randint(1, 3), current=rng.randint(0, 2)) for j in range(12)]
    first = share_slots(many, 9)
    assert sum(first.values()) == 9 and all(first[c.adapter] <= c.desired for c in many)
    for _ in range(5):
        rng.shuffle(many)
        assert share_slots(many, 9) == first
    with pytest.raises(ValueError, match="margin"):
        share_slots(many, 9, margin=0.5)


def test_oscillating_demand_takes_a_bounded_number_of_scale_ups() -> None:
    """Decide every 10 s for 20 minutes of 30 s high, 30 s low: with the window, replicas go
    up once and hold through every dip; without it they follow each swing."""
    oscillating = [16.0 if (step // 3) % 2 == 0 else 2.0 for step in range(120)]

    def added(policy: ScalingPolicy) -> int:
        state, desired, total = ScalingState(), 0, 0
        for step, demand in enumerate(oscillating):
            decision, state = decide("osc", policy, state, desired, demand, step * 10.0)
            total += max(0, decision.to_replicas - desired)
            desired = decision.to_replicas
        return total

    assert added(ScalingPolicy(0, 4, 4.0, scale_down_window_s=300.0)) == 4
    assert added(ScalingPolicy(0, 4, 4.0, scale_down_window_s=0.0)) >= 3 * 19
