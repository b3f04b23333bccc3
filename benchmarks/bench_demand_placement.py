"""Demand placement against random placement and plain rendezvous hashing: a SIMULATION (no
cluster, no agents, no engine) of NVIDIA Dynamo's LoRA-placement set-up, as issue 38 cites it:
100 adapters, 8 workers × 4 slots, 200 ticks, drifting Zipf demand.

The demand model follows Dynamo's own simulation harness (ai-dynamo/dynamo,
lib/llm/tests/lora_simulation/workloads.rs, `generate_zipf_poisson_schedules`): adapter of
popularity rank k gets Poisson(λ_k) requests per tick, λ_k = total × k^-s / H(L, s), total 40
requests per tick, s = 1, 3-second ticks. Assumed here (Dynamo's text gives no drift rule that
we found): the popularity ranks drift by one swap of two adjacent ranks per tick.

Each tick, every strategy places adapters from the requests it saw up to the tick before; the
tick's requests are then served. Measured per strategy, over several seeds (mean ± spread):
* churn: adapter-replica additions + removals over the run, as Dynamo counts it (the first
  placement's additions included), and the loads alone;
* resident-hit share: the tick's requests whose adapter is resident on some worker then (the
  others would load it on first request, or wait).

Strategies: random (each tick a fresh random choice of workers with room; Dynamo's replica
budget: proportional to a 30-tick windowed rate, within the 32 slots, as its `LoraController`);
plain rendezvous hashing (the same budget, each adapter's top workers with room by HRW, no
stickiness); lorafleet (`lorafleet_operator.demand`: EMA-smoothed demand, HPA-like replicas,
the scale-down window and scale-up limits, slots shared by demand per replica with a margin for
held replicas; then the operator's one placement rule, `lorafleet_operator.placement.place`:
sticky, least-loaded agents with room for new replicas). Dynamo's published figures are printed beside them, as the
issue quotes them (random ~35,000 loads, rendezvous ~250, min-cost flow 88–136).

Run: `. scripts/bootstrap.sh && python benchmarks/bench_demand_placement.py` (CPU, seconds).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from lorafleet_operator.demand import (
    DEFAULT_MARGIN,
    DEFAULT_SMOOTHING_S,
    ScalingPolicy,
    ScalingState,
    SlotClaim,
    decide,
    share_slots,
    smoothed_demand,
)
from lorafleet_operator.placement import Candidate, Demand, place

ADAPTERS, WORKERS, SLOTS, TICKS = 100, 8, 4, 200
TICK_S = 3.0
ZIPF_S, TOTAL_LOAD = 1.0, 40.0
DRIFT_SWAPS_PER_TICK = 1
#: Dynamo's rate window: 30 × the 3-second tick.
RATE_WINDOW_TICKS = 30
BASE_MODEL = "base"
NAMES = [f"lora-{i:03d}" for i in range(ADAPTERS)]
PODS = [f"worker-{i}" for i in range(WORKERS)]
#: lorafleet's settings in this simulation: demand in requests per tick, the HPA's default
#: window (300 s) and scale-up limits.
POLICY = ScalingPolicy(min_replicas=0, max_replicas=WORKERS, target_per_replica=4.0, scale_down_window_s=300.0)
SMOOTHING_S = float(DEFAULT_SMOOTHING_S)
MARGIN = DEFAULT_MARGIN
#: As issue 38 quotes Dynamo's "Optimal LoRA Placement" study (churn over the run).
DYNAMO_PUBLISHED = {"random": "~35,000", "rendezvous (HRW)": "~250", "min-cost flow": "88–136"}

Placement = dict[str, frozenset[str]]


def demand_trace(seed: int) -> list[dict[str, int]]:
    """Requests per adapter per tick: Zipf popularity over drifting ranks, Poisson arrivals."""
    rng = np.random.default_rng(seed)
    weights = [k**-ZIPF_S for k in range(1, ADAPTERS + 1)]
    harmonic = sum(weights)
    ranked = list(NAMES)  # ranked[k]: the adapter of popularity rank k + 1
    trace = []
    for _ in range(TICKS):
        for _ in range(DRIFT_SWAPS_PER_TICK):
            k = int(rng.integers(ADAPTERS - 1))
            ranked[k], ranked[k + 1] = ranked[k + 1], ranked[k]
        trace.append({name: int(rng.poisson(TOTAL_LOAD * w / harmonic)) for name, w in zip(ranked, weights, strict=True)})
    return trace


def dynamo_budget(window_loads: dict[str, int]) -> dict[str, int]:
    """Dynamo's replica budget (its `compute_normalized_replica_counts`): the busiest adapters up
    to the slot count, each ceil(share × slots) within [1, workers], scaled down to the slots
    with the largest remainders when over."""
    slots = WORKERS * SLOTS
    ranked = sorted(((n, load) for n, load in window_loads.items() if load > 0), key=lambda x: (-x[1], x[0]))[:slots]
    total = sum(load for _, load in ranked)
    if not total:
        return {}
    raw = {n: min(float(WORKERS), max(1.0, math.ceil(load / total * slots))) for n, load in ranked}
    if sum(raw.values()) <= slots:
        return {n: int(c) for n, c in raw.items()}
    scale = slots / sum(raw.values())
    scaled = {n: max(1.0, c * scale) for n, c in raw.items()}
    counts = {n: max(1, math.floor(c)) for n, c in scaled.items()}
    leftover = slots - sum(counts.values())
    for n in sorted(scaled, key=lambda n: (-(scaled[n] - counts[n]), n)):
        if leftover <= 0:
            break
        if counts[n] < WORKERS:
            counts[n] += 1
            leftover -= 1
    return counts


def rendezvous_order(adapter: str, pods: Sequence[str]) -> list[str]:
    """``pods`` by the adapter's highest-random-weight score (blake2b of adapter and pod)."""

    def score(pod: str) -> int:
        return int.from_bytes(hashlib.blake2b(f"{adapter}\0{pod}".encode(), digest_size=8).digest(), "big")

    return sorted(pods, key=lambda pod: (-score(pod), pod))


def random_placement(counts: dict[str, int], rng: random.Random) -> Placement:
    """Each adapter's replicas on random workers with room, afresh every tick."""
    used = dict.fromkeys(PODS, 0)
    placed = {}
    for name in sorted(counts):
        room = [p for p in PODS if used[p] < SLOTS]
        chosen = rng.sample(room, min(counts[name], len(room)))
        for pod in chosen:
            used[pod] += 1
        placed[name] = frozenset(chosen)
    return placed


def rendezvous_placement(counts: dict[str, int]) -> Placement:
    """Each adapter's replicas on its highest-ranked workers with room (slot-aware HRW)."""
    used = dict.fromkeys(PODS, 0)
    placed = {}
    for name in sorted(counts):
        chosen = [p for p in rendezvous_order(name, PODS) if used[p] < SLOTS][: counts[name]]
        for pod in chosen:
            used[pod] += 1
        placed[name] = frozenset(chosen)
    return placed


def windowed(trace: Sequence[dict[str, int]], tick: int) -> dict[str, int]:
    """Requests per adapter over the rate window before ``tick``."""
    window = trace[max(0, tick - RATE_WINDOW_TICKS) : tick]
    return {n: sum(t[n] for t in window) for n in NAMES}


@dataclass
class Lorafleet:
    """lorafleet's loop as the operator runs it each drift check: smooth, decide, share the
    slots, place (placement's rule, as the operator's drift check calls it)."""

    smoothing_s: float = SMOOTHING_S
    margin: float = MARGIN
    demand: dict[str, float] = field(default_factory=dict)
    states: dict[str, ScalingState] = field(default_factory=dict)
    desired: dict[str, int] = field(default_factory=dict)
    placed: Placement = field(default_factory=dict)

    def step(self, observed: dict[str, int], now: float) -> Placement:
        claims = []
        for name in NAMES:
            self.demand[name] = smoothed_demand(self.demand.get(name), TICK_S, observed[name], self.smoothing_s)
            decision, self.states[name] = decide(
                name, POLICY, self.states.get(name, ScalingState()), self.desired.get(name, 0), self.demand[name], now
            )
            self.desired[name] = decision.to_replicas
            current = len(self.placed.get(name, ()))
            claims.append(SlotClaim(name, self.demand[name], decision.to_replicas, current, POLICY.min_replicas))
        granted = share_slots(claims, WORKERS * SLOTS, self.margin)
        # What each worker holds once the replicas no longer granted are unloaded (the drift
        # check unloads them before the next round's placement sees their room).
        kept = {n: sorted(pods)[: granted[n]] for n, pods in self.placed.items()}
        held = {p: frozenset(n for n, pods in kept.items() if p in pods) for p in PODS}
        agents = [Candidate(p, p, True, base_model=BASE_MODEL, max_lora_rank=64, max_loaded_loras=SLOTS, held=held[p]) for p in PODS]
        demands = [Demand(n, BASE_MODEL, granted[n], None, ("", n), tuple(kept.get(n, ()))) for n in NAMES]
        self.placed = {n: frozenset(p.placed) for n, p in place(agents, demands).items() if p.placed}
        return self.placed


@dataclass(frozen=True)
class Outcome:
    """One strategy on one seed."""

    churn: int
    loads: int
    hit_share: float


def run(trace: Sequence[dict[str, int]], strategy: Callable[[int], Placement]) -> Outcome:
    """Place each tick from what was seen before it, serve the tick, count churn and hits."""
    before: set[tuple[str, str]] = set()
    churn = loads = hits = requests = 0
    for tick, arrivals in enumerate(trace):
        placement = strategy(tick)
        now = {(n, p) for n, pods in placement.items() for p in pods}
        loads += len(now - before)
        churn += len(now - before) + len(before - now)
        before = now
        requests += sum(arrivals.values())
        hits += sum(count for name, count in arrivals.items() if placement.get(name))
    return Outcome(churn, loads, hits / requests)


def run_lorafleet(trace: Sequence[dict[str, int]], fleet: Lorafleet) -> Outcome:
    """lorafleet's loop over a trace, each tick seeing the requests of the tick before."""
    empty = dict.fromkeys(NAMES, 0)
    return run(trace, lambda t: fleet.step(trace[t - 1] if t else empty, t * TICK_S))


def outcomes(seed: int) -> dict[str, Outcome]:
    """Every strategy over the same trace."""
    trace = demand_trace(seed)
    rng = random.Random(seed)
    return {
        "random": run(trace, lambda t: random_placement(dynamo_budget(windowed(trace, t)), rng)),
        "rendezvous (HRW)": run(trace, lambda t: rendezvous_placement(dynamo_budget(windowed(trace, t)))),
        "lorafleet": run_lorafleet(trace, Lorafleet()),
    }


def sweep(seeds: int) -> None:
    """lorafleet's churn and resident-hit share over its two settings: the smoothing time
    constant and the margin of held replicas (how the defaults were chosen)."""
    traces = [demand_trace(seed) for seed in range(seeds)]
    print(f"lorafleet's settings, seeds 0–{seeds - 1}: mean churn / resident-hit share")
    margins = (1.0, 1.5, 2.0, 2.5, 3.0)
    print(f"{'smoothing τ':<12} | " + " | ".join(f"margin {m:g}".ljust(18) for m in margins))
    for tau in (15.0, 30.0, 60.0, 150.0, 300.0):
        cells = []
        for margin in margins:
            per = [run_lorafleet(t, Lorafleet(smoothing_s=tau, margin=margin)) for t in traces]
            cells.append(
                f"{statistics.fmean(o.churn for o in per):,.0f} / {100 * statistics.fmean(o.hit_share for o in per):.1f} %".ljust(18)
            )
        print(f"{tau:>9g} s  | " + " | ".join(cells))


def spread(values: Sequence[float], digits: int) -> str:
    """Mean ± standard deviation (min–max)."""
    mean, sd = statistics.fmean(values), statistics.pstdev(values)
    return f"{mean:,.{digits}f} ± {sd:,.{digits}f} ({min(values):,.{digits}f}–{max(values):,.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--sweep", action="store_true", help="also print lorafleet's settings against churn and hits")
    args = parser.parse_args()
    runs = [outcomes(seed) for seed in range(args.seeds)]
    print(
        f"SIMULATION of Dynamo's set-up: {ADAPTERS} adapters, {WORKERS} workers × {SLOTS} slots, {TICKS} ticks of {TICK_S:g} s, "
        f"Zipf s={ZIPF_S:g} over ranks drifting by {DRIFT_SWAPS_PER_TICK} adjacent swap(s) per tick, Poisson arrivals "
        f"({TOTAL_LOAD:g} requests per tick in all); seeds 0–{args.seeds - 1}: mean ± sd (min–max)"
    )
    print(f"{'strategy':<18} | {'churn (adds + removes)':<34} | {'loads':<34} | {'resident-hit share':<30} | Dynamo's published churn")
    for name in runs[0]:
        per = [r[name] for r in runs]
        churn = spread([o.churn for o in per], 0)
        loads = spread([o.loads for o in per], 0)
        share = spread([100 * o.hit_share for o in per], 1) + " %"
        print(f"{name:<18} | {churn:<34} | {loads:<34} | {share:<30} | {DYNAMO_PUBLISHED.get(name, '—')}")
    print("lorafleet's churn per seed: " + ", ".join(str(r["lorafleet"].churn) for r in runs))
    print(f"{'min-cost flow':<18} | {'not simulated':<34} | {'':<34} | {'':<30} | {DYNAMO_PUBLISHED['min-cost flow']}")
    print(
        f"lorafleet: demand smoothed over τ {SMOOTHING_S:g} s, {POLICY.target_per_replica:g} requests per tick per replica, "
        f"replicas in [{POLICY.min_replicas}, {POLICY.max_replicas}], scale-down window {POLICY.scale_down_window_s:g} s, "
        f"the HPA's default scale-up limits, margin of held replicas {MARGIN:g}"
    )
    if args.sweep:
        sweep(min(args.seeds, 3))


if __name__ == "__main__":
    main()
