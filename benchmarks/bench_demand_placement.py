"""Demand placement against random placement and plain rendezvous hashing: a SIMULATION (no
cluster, no agents, no engine) of NVIDIA Dynamo's LoRA-placement set-up, as issue 38 cites it:
100 adapters, 8 workers × 4 slots, 200 ticks of 3 s, Zipf demand. Two modes.

Default mode (drifting Zipf, placement residency). The demand model follows Dynamo's own
simulation harness (ai-dynamo/dynamo, lib/llm/tests/lora_simulation/workloads.rs,
`generate_zipf_poisson_schedules`): adapter of popularity rank k gets Poisson(λ_k) requests per
tick, λ_k = total × k^-s / H(L, s), total 40 requests per tick, s = 1. Added here (Dynamo's
ranks are static): the ranks drift by one swap of two adjacent ranks per tick. Each tick, every
strategy places adapters from the requests it saw up to the tick before; the tick's requests
are then served. Measured per strategy, over several seeds (mean ± spread):
* churn: adapter-replica additions + removals over the run (the first placement's additions
  included), and the loads alone;
* resident-hit share: the tick's requests whose adapter is placed on some worker then.

`--dynamo` mode (Dynamo's harness, its definitions). Dynamo's four workloads as its harness
generates them (dynamo-llm 1.6.1, tests/lora_simulation/workloads.rs and csv_export.rs):
static Zipf s = 1 ranks, Poisson arrivals around a total rate per tick (Zipf + Poisson: 40;
daily: 10 to 50 over a 100-tick day; spike: 25, times 5 at ticks 50 and 130, halving every 8
ticks; MMPP: a 3-state Markov chain of rates 15/40/70). Each tick every strategy places from the
requests seen up to and including that tick (as Dynamo's controller reads its rate window
before the tick's requests are served); the placement is the requests' routing targets, and
residency follows the requests alone, as in Dynamo's `ResidencyModel` behind its `LoraFilter`:
each request goes, in turn (a cursor per adapter), to one of its candidates (the replica
workers holding the adapter, else all its replica workers; an adapter without replicas: the
workers holding it, else every worker), and is a hit when the adapter is resident there; a
miss loads it there, evicting that worker's least recently used adapter when its 4 slots are
full. Measured: route churn (replica additions + removals), adapter churn (the request path's
loads + evictions) and the hit share. `--trace-csv DIR` replays the per-tick loads Dynamo's
export wrote (DIR/<scenario>_load.csv) instead of drawing them, so both run on the same draws.

Strategies: random (each tick a fresh random choice of workers with room; Dynamo's replica
budget: proportional to a 30-tick windowed rate, within the 32 slots, as its `LoraController`);
plain rendezvous hashing (the same budget, each adapter's top workers with room by HRW, no
stickiness); lorafleet (`lorafleet_operator.demand`: EMA-smoothed demand, HPA-like replicas,
the scale-down window and scale-up limits, slots shared by demand per replica with a margin for
held replicas; then the operator's one placement rule, `lorafleet_operator.placement.place`:
sticky, least-loaded agents with room for new replicas). Random and rendezvous here are this
simulation's approximations of Dynamo's (no cold-start pins, no hysteresis); Dynamo's own
figures are printed beside them: its study's published churn in the default mode, and in
`--dynamo` mode what its harness measured when run here.

Run: `. scripts/bootstrap.sh && python benchmarks/bench_demand_placement.py [--dynamo]` (CPU).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import math
import random
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

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
#: Dynamo's "Optimal LoRA Placement" study (ai-dynamo/dynamo docs/blogs/lora-placement/, March
#: 2026, data in tools/gen_churn_bars.py at 24a57cc8): routing-target churn over 200 ticks, its
#: four static-Zipf workloads, one seed each (lowest–highest).
DYNAMO_PUBLISHED = {"random": "33,824–35,752", "rendezvous (HRW)": "238–281", "min-cost flow": "88–136"}
DYNAMO_SCENARIOS = ("hot_lora_poisson", "daily", "spike", "mmpp")
MMPP_RATES = (15.0, 40.0, 70.0)
MMPP_TRANSITIONS = ((0.90, 0.10, 0.00), (0.15, 0.80, 0.05), (0.10, 0.20, 0.70))
#: What Dynamo's harness measured when run here (dynamo-llm 1.6.1 from crates.io, vcs commit
#: 0d9c24a8, its `tests/lora_simulation` with the export's settings, seeds 0–9 of its own
#: generators): route churn, adapter churn (request-path loads + evictions), hit share (%), means.
DYNAMO_MEASURED = {
    "hot_lora_poisson": {"random": (34046, 8437, 47.2), "HRW": (1223, 5401, 66.1), "MCF": (391, 5275, 66.9)},
    "daily": {"random": (31683, 6493, 45.6), "HRW": (1240, 4040, 66.0), "MCF": (502, 3973, 66.6)},
    "spike": {"random": (33232, 7612, 48.5), "HRW": (1162, 5021, 66.0), "MCF": (428, 4938, 66.5)},
    "mmpp": {"random": (32296, 6201, 45.8), "HRW": (1210, 3886, 66.1), "MCF": (505, 3825, 66.6)},
}
#: The same harness on its export's own seed, 42, whose loads `--trace-csv` replays.
DYNAMO_MEASURED_SEED_42 = {
    "hot_lora_poisson": {"random": (33684, 8396, 47.8), "HRW": (1246, 5374, 66.5), "MCF": (389, 5210, 67.5)},
    "daily": {"random": (31627, 6506, 46.3), "HRW": (1328, 4126, 65.8), "MCF": (444, 3978, 67.1)},
    "spike": {"random": (33015, 7542, 49.4), "HRW": (1301, 4996, 66.4), "MCF": (374, 4924, 66.9)},
    "mmpp": {"random": (30466, 5020, 44.3), "HRW": (1109, 2928, 67.4), "MCF": (565, 2862, 68.1)},
}

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


def dynamo_total_rates(scenario: str, rng: np.random.Generator) -> list[float]:
    """Requests per tick in all, per Dynamo workload (its export's parameters)."""
    if scenario == "hot_lora_poisson":
        return [TOTAL_LOAD] * TICKS
    if scenario == "daily":
        return [30.0 - 20.0 * math.cos(2 * math.pi * (t % 100) / 100) for t in range(TICKS)]
    if scenario == "spike":
        return [25.0 * (1 + sum(4.0 * 0.5 ** ((t - f) / 8.0) for f in (50, 130) if t >= f)) for t in range(TICKS)]
    if scenario != "mmpp":
        raise ValueError(f"unknown Dynamo workload {scenario!r}; expected one of {DYNAMO_SCENARIOS}")
    rates, state = [], 0
    for _ in range(TICKS):
        rates.append(MMPP_RATES[state])
        state = int(rng.choice(len(MMPP_RATES), p=MMPP_TRANSITIONS[state]))
    return rates


def dynamo_trace(scenario: str, seed: int) -> list[dict[str, int]]:
    """Requests per adapter per tick of one Dynamo workload: static Zipf ranks, Poisson arrivals."""
    rng = np.random.default_rng(seed)
    weights = np.array([k**-ZIPF_S for k in range(1, ADAPTERS + 1)])
    weights /= weights.sum()
    return [dict(zip(NAMES, map(int, rng.poisson(rate * weights)), strict=True)) for rate in dynamo_total_rates(scenario, rng)]


def read_trace(path: Path) -> list[dict[str, int]]:
    """Per-tick loads as Dynamo's export writes them (a `lora-NNN` column per adapter)."""
    with path.open(newline="") as f:
        return [{name: int(row.get(name) or 0) for name in NAMES} for row in csv.DictReader(f)]


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


def replicas_of(placement: Placement) -> set[tuple[str, str]]:
    """Every (adapter, worker) replica of a placement."""
    return {(n, p) for n, pods in placement.items() for p in pods}


def run(trace: Sequence[dict[str, int]], strategy: Callable[[int], Placement]) -> Outcome:
    """Place each tick from what was seen before it, serve the tick, count churn and hits."""
    before: set[tuple[str, str]] = set()
    churn = loads = hits = requests = 0
    for tick, arrivals in enumerate(trace):
        placement = strategy(tick)
        now = replicas_of(placement)
        loads += len(now - before)
        churn += len(now ^ before)
        before = now
        requests += sum(arrivals.values())
        hits += sum(count for name, count in arrivals.items() if placement.get(name))
    return Outcome(churn, loads, hits / requests)


@dataclass(frozen=True)
class Served:
    """One tick's requests through the request path."""

    hits: int
    loads: int
    evictions: int


@dataclass
class RequestPath:
    """Dynamo's simulated request path (its harness's `ResidencyModel` behind `LoraFilter`):
    residency follows the requests alone, a least-recently-used list of `SLOTS` per worker."""

    resident: dict[str, list[str]] = field(default_factory=lambda: {pod: [] for pod in PODS})
    cursor: Counter[str] = field(default_factory=Counter)

    def candidates(self, name: str, routes: Placement) -> list[str]:
        """The filter's workers for one request: replicas holding it, else all its replicas; an
        adapter without replicas: the workers holding it, else every worker."""
        holding = [pod for pod in PODS if name in self.resident[pod]]
        replicas = [pod for pod in PODS if pod in routes.get(name, ())]
        if replicas:
            return [pod for pod in replicas if pod in holding] or replicas
        return holding or list(PODS)

    def serve(self, arrivals: dict[str, int], routes: Placement) -> Served:
        """Each request to its next candidate in turn: a hit when resident there, else a load
        (evicting the least recently used adapter of a full worker)."""
        hits = loads = evictions = 0
        for name in sorted(arrivals):
            for _ in range(arrivals[name]):
                options = self.candidates(name, routes)
                held = self.resident[options[self.cursor[name] % len(options)]]
                self.cursor[name] += 1
                if name in held:
                    hits += 1
                    held.remove(name)
                else:
                    loads += 1
                    if len(held) >= SLOTS:
                        held.pop(0)
                        evictions += 1
                held.append(name)
        return Served(hits, loads, evictions)


@dataclass(frozen=True)
class DynamoOutcome:
    """One strategy on one trace, measured as Dynamo's harness measures."""

    route_churn: int
    adapter_churn: int
    hit_share: float


def run_request_path(trace: Sequence[dict[str, int]], strategy: Callable[[int], Placement]) -> DynamoOutcome:
    """Each tick: place (the strategy sees the tick's requests), count the routes that changed,
    then serve the tick's requests through the request path."""
    path = RequestPath()
    before: set[tuple[str, str]] = set()
    route_churn = adapter_churn = hits = requests = 0
    for tick, arrivals in enumerate(trace):
        now = replicas_of(routes := strategy(tick))
        route_churn += len(now ^ before)
        before = now
        served = path.serve(arrivals, routes)
        adapter_churn += served.loads + served.evictions
        hits += served.hits
        requests += sum(arrivals.values())
    return DynamoOutcome(route_churn, adapter_churn, hits / requests)


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


def dynamo_outcomes(trace: Sequence[dict[str, int]], seed: int) -> dict[str, DynamoOutcome]:
    """Every strategy over one trace in Dynamo's harness, each placing from the requests seen up
    to and including the tick."""
    rng = random.Random(seed)
    fleet = Lorafleet()
    return {
        "random": run_request_path(trace, lambda t: random_placement(dynamo_budget(windowed(trace, t + 1)), rng)),
        "HRW": run_request_path(trace, lambda t: rendezvous_placement(dynamo_budget(windowed(trace, t + 1)))),
        "lorafleet": run_request_path(trace, lambda t: fleet.step(trace[t], t * TICK_S)),
    }


def dynamo_figures(figures: tuple[int, int, float] | None) -> str:
    """Dynamo's measured route churn / adapter churn / hit share, or a dash."""
    return f"{figures[0]:,} / {figures[1]:,} / {figures[2]:.1f} %" if figures else "—"


def report_dynamo(seeds: int, trace_dir: Path | None) -> None:
    """Dynamo's workloads and definitions: per workload, every strategy beside Dynamo's own run."""
    measured = DYNAMO_MEASURED_SEED_42 if trace_dir else DYNAMO_MEASURED
    draws = f"the loads Dynamo's export wrote to {trace_dir} (its seed 42)" if trace_dir else f"seeds 0–{seeds - 1}: mean ± sd (min–max)"
    print(
        f"SIMULATION of Dynamo's harness (dynamo-llm 1.6.1 tests/lora_simulation): {ADAPTERS} adapters, {WORKERS} workers × "
        f"{SLOTS} slots, {TICKS} ticks of {TICK_S:g} s, static Zipf s={ZIPF_S:g} ranks, Poisson arrivals, requests through "
        f"Dynamo's filter to a least-recently-used residency per worker; {draws}"
    )
    print(
        f"{'workload':<17} | {'strategy':<9} | {'route churn':<32} | {'adapter churn (loads + evictions)':<33} | "
        f"{'resident-hit share':<24} | Dynamo's harness: route / adapter churn / hit share"
    )
    for scenario in DYNAMO_SCENARIOS:
        if trace_dir:
            traces = [read_trace(trace_dir / f"{scenario}_load.csv")]
        else:
            traces = [dynamo_trace(scenario, seed) for seed in range(seeds)]
        runs = [dynamo_outcomes(trace, seed) for seed, trace in enumerate(traces)]
        for name in ("random", "HRW", "lorafleet", "MCF"):
            cells = dynamo_cells([r[name] for r in runs if name in r])
            print(f"{scenario:<17} | {name:<9} | {cells} | {dynamo_figures(measured[scenario].get(name))}")


def dynamo_cells(per: Sequence[DynamoOutcome]) -> str:
    """One strategy's route churn, adapter churn and hit share over its runs."""
    if not per:
        return f"{'not simulated':<32} | {'':<33} | {'':<24}"
    route = spread([o.route_churn for o in per], 0)
    adapter = spread([o.adapter_churn for o in per], 0)
    share = spread([100 * o.hit_share for o in per], 1) + " %"
    return f"{route:<32} | {adapter:<33} | {share:<24}"


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
    """Mean ± standard deviation (min–max); one value alone."""
    if len(values) == 1:
        return f"{values[0]:,.{digits}f}"
    mean, sd = statistics.fmean(values), statistics.pstdev(values)
    return f"{mean:,.{digits}f} ± {sd:,.{digits}f} ({min(values):,.{digits}f}–{max(values):,.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--sweep", action="store_true", help="also print lorafleet's settings against churn and hits")
    parser.add_argument("--dynamo", action="store_true", help="Dynamo's four workloads, request path and definitions")
    parser.add_argument("--trace-csv", type=Path, help="with --dynamo: replay the loads Dynamo's export wrote to this folder")
    args = parser.parse_args()
    if args.dynamo:
        report_dynamo(args.seeds, args.trace_csv)
        return
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
