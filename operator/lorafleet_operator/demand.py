"""Demand → replicas (docs/scaling.md): how many agents should hold an adapter, decided as the
HorizontalPodAutoscaler decides a Deployment's replicas, as pure functions over plain values.

* Demand is what the agents measure per adapter (requests running and waiting, or generated
  tokens per second), smoothed by the caller with :func:`smooth` so one noisy sample moves
  nothing.
* The recommendation is ``ceil(demand / target per replica)`` clamped to ``[min, max]``.
* Scale-down stabilisation (the HPA's ``behavior.scaleDown.stabilizationWindowSeconds``): the
  replicas never fall below the highest recommendation made within the window, so a dip shorter
  than the window holds them, and they follow demand down once the window has passed.
* Scale-up rate limit (the HPA's ``behavior.scaleUp.policies``, ``selectPolicy: Max``): per
  period, at most N replicas more or P% more than at the period's start, whichever allows more.
  A percentage of zero replicas is zero: starting from zero needs a replicas limit.

* Scarcity (:func:`share_slots`): when a fleet's slots cannot hold every adapter's replicas,
  they are granted by demand per replica (the k-th replica of an adapter is worth
  ``demand / k``), replicas under an adapter's minimum first; a replica an adapter holds now
  counts ``margin`` times its worth, so two adapters of about equal demand never trade a slot
  back and forth. Where the granted replicas go is placement's rule
  (:mod:`~lorafleet_operator.placement`), the one for every adapter.

No clock is read: every decision is given ``now`` (seconds, the caller's monotonic clock), and
returns the state the next decision needs.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


class LimitKind(enum.StrEnum):
    """How a scale-up limit counts: replicas, or a percentage of the period's start."""

    REPLICAS = "Replicas"
    PERCENT = "Percent"


@dataclass(frozen=True)
class ScaleUpLimit:
    """At most ``value`` replicas (or percent) more per ``period_s`` seconds."""

    kind: LimitKind
    value: int
    period_s: float

    def __post_init__(self) -> None:
        if self.value <= 0 or not self.period_s > 0:
            raise ValueError(f"a scale-up limit needs a positive value and period, not {self.value} per {self.period_s} s")

    def allowed(self, period_start: int) -> int:
        """The most replicas this limit allows when the period began at ``period_start``."""
        if self.kind is LimitKind.REPLICAS:
            return period_start + self.value
        return math.ceil(period_start * (100 + self.value) / 100)


#: The HPA's default scale-up behaviour: 100% or 4 replicas per 15 s, whichever is more.
DEFAULT_SCALE_UP = (ScaleUpLimit(LimitKind.PERCENT, 100, 15.0), ScaleUpLimit(LimitKind.REPLICAS, 4, 15.0))


@dataclass(frozen=True)
class ScalingPolicy:
    """One adapter's scaling: its bounds, the demand one replica is meant to carry, the
    scale-down window and the scale-up limits (none: unlimited)."""

    min_replicas: int
    max_replicas: int
    target_per_replica: float
    scale_down_window_s: float = 300.0
    scale_up_limits: tuple[ScaleUpLimit, ...] = DEFAULT_SCALE_UP

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"replicas must satisfy 0 <= min <= max and max >= 1, not [{self.min_replicas}, {self.max_replicas}]")
        if not (math.isfinite(self.target_per_replica) and self.target_per_replica > 0):
            raise ValueError(f"the target per replica must be a positive number, not {self.target_per_replica}")
        if not self.scale_down_window_s >= 0:
            raise ValueError(f"the scale-down window must be at least 0 s, not {self.scale_down_window_s}")

    def clamp(self, replicas: int) -> int:
        """``replicas`` within ``[min_replicas, max_replicas]``."""
        return max(self.min_replicas, min(self.max_replicas, replicas))


@dataclass(frozen=True)
class Recommendation:
    """A replica count recommended at a time: the scale-down window's memory."""

    at: float
    replicas: int


@dataclass(frozen=True)
class ScaleUp:
    """Replicas added at a time: the rate limit's memory."""

    at: float
    added: int


@dataclass(frozen=True)
class ScalingState:
    """What one adapter's next decision needs of the past (empty for a new adapter)."""

    recommendations: tuple[Recommendation, ...] = ()
    scale_ups: tuple[ScaleUp, ...] = ()


@dataclass(frozen=True)
class AdapterScaling:
    """One adapter's scaling as kept between decisions: their state, the replicas decided,
    those granted within the fleet's slots (:func:`share_slots`), and the last demand known."""

    #: The LoraAdapter's uid: a new object of the same name starts afresh.
    uid: str
    state: ScalingState
    desired: int
    granted: int
    #: The smoothed demand (:func:`smoothed_demand`) and when it was last sampled (None: never).
    demand: float = 0.0
    sampled_at: float | None = None


class ScalingReason(enum.StrEnum):
    """Why an adapter's replica count is what it is now."""

    STEADY = "Steady"
    SCALED_UP = "ScaledUp"
    RATE_LIMITED = "ScaleUpLimited"
    SCALED_DOWN = "ScaledDown"
    HELD = "HeldByWindow"


@dataclass(frozen=True)
class ScalingDecision:
    """One adapter's decision: from → to replicas, the demand and recommendation behind it, why."""

    adapter: str
    from_replicas: int
    to_replicas: int
    reason: ScalingReason
    demand: float
    recommended: int
    message: str


def smooth(previous: float | None, observed: float, weight: float) -> float:
    """An exponential moving average: ``weight`` of the new sample, the rest of the past
    (``previous`` None: the sample itself)."""
    if not (math.isfinite(observed) and observed >= 0):
        raise ValueError(f"a demand sample must be a finite number >= 0, not {observed}")
    if not 0 < weight <= 1:
        raise ValueError(f"a smoothing weight must be in (0, 1], not {weight}")
    return observed if previous is None else previous + weight * (observed - previous)


def smoothing_weight(interval_s: float, time_constant_s: float) -> float:
    """The :func:`smooth` weight of a sample taken ``interval_s`` after the last, for an
    average that forgets with ``time_constant_s`` whatever the sampling rate."""
    if not (interval_s > 0 and time_constant_s > 0):
        raise ValueError(f"an interval and a time constant must be positive, not {interval_s} and {time_constant_s}")
    return 1 - math.exp(-interval_s / time_constant_s)


#: ``spec.scaling.behavior.demandSmoothingSeconds``' default: the time constant demand is
#: averaged over (benchmarks/bench_demand_placement.py --sweep: shorter ones trade slots on noise).
DEFAULT_SMOOTHING_S = 150


def smoothed_demand(previous: float | None, since_s: float, observed: float, time_constant_s: float) -> float:
    """The demand a decision uses: ``observed``, sampled ``since_s`` after the last sample,
    averaged with the past demand (``previous``; None: this is the first sample, taken as it
    is) over ``time_constant_s`` (0: each sample as it is, as the HPA uses it)."""
    if previous is None or time_constant_s <= 0:
        return smooth(None, observed, 1.0)
    if since_s <= 0:  # no time has passed: the past stands
        return previous
    return smooth(previous, observed, smoothing_weight(since_s, time_constant_s))


def recommend(policy: ScalingPolicy, demand: float) -> int:
    """``ceil(demand / target per replica)`` within the policy's bounds."""
    if not (math.isfinite(demand) and demand >= 0):
        raise ValueError(f"demand must be a finite number >= 0, not {demand}")
    return policy.clamp(math.ceil(demand / policy.target_per_replica))


def _rate_cap(policy: ScalingPolicy, state: ScalingState, current: int, now: float) -> int | None:
    """The most replicas the scale-up limits allow now (None: no limit)."""
    caps = []
    for limit in policy.scale_up_limits:
        added = sum(e.added for e in state.scale_ups if now - e.at < limit.period_s)
        caps.append(limit.allowed(max(0, current - added)))
    return max(caps) if caps else None


def decide(
    adapter: str, policy: ScalingPolicy, state: ScalingState, current: int, demand: float, now: float
) -> tuple[ScalingDecision, ScalingState]:
    """The adapter's replicas now, given its (smoothed) demand and ``current`` replicas, and the
    state for the next decision."""
    if current < 0:
        raise ValueError(f"current replicas must be >= 0, not {current}")
    recommended = recommend(policy, demand)
    window = tuple(r for r in state.recommendations if now - r.at < policy.scale_down_window_s)
    window += (Recommendation(now, recommended),)
    highest = max(r.replicas for r in window)
    cap = _rate_cap(policy, state, current, now)
    if recommended > current:
        wanted = recommended if cap is None else max(current, min(recommended, cap))
    else:
        wanted = min(current, highest)
    to = policy.clamp(wanted)
    reason, message = _explain(policy, current, to, recommended, demand)
    longest = max((limit.period_s for limit in policy.scale_up_limits), default=0.0)
    ups = tuple(e for e in state.scale_ups if now - e.at < longest)
    if to > current:
        ups += (ScaleUp(now, to - current),)
    decision = ScalingDecision(adapter, current, to, reason, demand, recommended, message)
    return decision, ScalingState(window, ups)


def _explain(policy: ScalingPolicy, current: int, to: int, recommended: int, demand: float) -> tuple[ScalingReason, str]:
    """The reason and message of a decision from ``current`` to ``to`` replicas."""
    head = f"demand {demand:.3g} at {policy.target_per_replica:g} per replica recommends {recommended}"
    if to == recommended == current:
        return ScalingReason.STEADY, f"{head}: {current} replica(s) kept"
    if recommended > to >= current:
        return ScalingReason.RATE_LIMITED, f"{head}: {current} → {to}, held by the scale-up limit"
    if to > current:
        return ScalingReason.SCALED_UP, f"{head}: {current} → {to}"
    if recommended < to:
        window = f"{policy.scale_down_window_s:g} s"
        return ScalingReason.HELD, f"{head}: {current} → {to}, held by the scale-down window ({window})"
    return ScalingReason.SCALED_DOWN, f"{head}: {current} → {to}"


@dataclass(frozen=True)
class SlotClaim:
    """One demand-scaled adapter asking for slots: its demand, the replicas :func:`decide`
    wants, those it holds now, and its minimum."""

    adapter: str
    demand: float
    desired: int
    current: int
    min_replicas: int


#: A held replica counts this many times its worth against a newcomer (>= 1).
#: A held replica's worth counts this many times (chosen with benchmarks/bench_demand_placement.py
#: --sweep: 2.5 kept every seed's churn within Dynamo's min-cost-flow range, 2 did not).
DEFAULT_MARGIN = 2.5


def share_slots(claims: Sequence[SlotClaim], slots: int, margin: float = DEFAULT_MARGIN) -> dict[str, int]:
    """Each adapter's replicas when the fleet has ``slots`` for all of them: every wanted
    replica ranked (under its minimum first, then by worth, a held one's times ``margin``;
    ties by name), the first ``slots`` granted. Deterministic whatever the claims' order."""
    if not margin >= 1:
        raise ValueError(f"the margin must be at least 1, not {margin}")
    ranked = sorted(
        (k > claim.min_replicas, -(claim.demand / k) * (margin if k <= claim.current else 1.0), claim.adapter, k)
        for claim in claims
        for k in range(1, claim.desired + 1)
    )
    granted = Counter(adapter for _, _, adapter, _ in ranked[: max(slots, 0)])
    return {claim.adapter: granted[claim.adapter] for claim in claims}
