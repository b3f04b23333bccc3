"""The scaling TTFT benchmark's own logic (benchmarks/bench_scaling_ttft.py), without a fleet:
the seeded Zipf trace, the route draw, and the table's and the target's arithmetic on
synthetic outcomes. No timing is measured here."""

from __future__ import annotations

import importlib.util
import itertools
import math
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_scaling_ttft.py"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script as a module (registered in sys.modules for its dataclasses, then removed)."""
    spec = importlib.util.spec_from_file_location("bench_scaling_ttft", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_scaling_ttft", module)
    spec.loader.exec_module(module)
    return module


def test_the_trace_is_seeded_ordered_and_skewed(bench: ModuleType) -> None:
    """The same seed gives the same trace, another seed another; arrivals only move forward;
    every adapter index is in range; popularity falls with the index as Zipf's law says."""
    trace = bench.zipf_trace(32, 4000, 8.0, 1.1, 0)
    assert trace == bench.zipf_trace(32, 4000, 8.0, 1.1, 0)
    assert trace != bench.zipf_trace(32, 4000, 8.0, 1.1, 1)
    assert len(trace) == 4000
    assert all(a.at_s < b.at_s for a, b in itertools.pairwise(trace))
    assert all(0 <= r.adapter < 32 and 0 <= r.route < 1 for r in trace)
    counts = Counter(r.adapter for r in trace)
    first_share = 1 / sum(k**-1.1 for k in range(1, 33))  # 1 / H(32, 1.1) ≈ 0.284
    assert counts[0] / len(trace) == pytest.approx(first_share, abs=0.03)
    assert counts[0] > counts[1] > counts[4] > counts[31] > 0


def test_the_mean_arrival_rate_is_the_rate_asked(bench: ModuleType) -> None:
    trace = bench.zipf_trace(8, 5000, 10.0, 1.0, 3)
    assert trace[-1].at_s == pytest.approx(500.0, rel=0.05)


def test_a_route_draw_picks_the_same_pod_whatever_the_listing_order(bench: ModuleType) -> None:
    assert bench.pick(0.0, ["agent-1", "agent-0"]) == "agent-0"
    assert bench.pick(0.99, ["agent-1", "agent-0"]) == "agent-1"
    assert bench.pick(0.5, ["agent-0", "agent-1", "agent-2"]) == "agent-1"
    assert bench.pick(0.999999, ["agent-0"]) == "agent-0"


def result(bench: ModuleType, mode: str, ttfts: list[float | None], *, held: int, configured: int) -> Any:
    outcomes = tuple(bench.Outcome(t, "" if t is not None else "503", listed=t is not None) for t in ttfts)
    return bench.ModeResult(mode, outcomes, slot_loads=3, operator_loads=1, slots_held=held, slots_configured=configured)


def test_failures_count_as_infinitely_slow_in_the_percentiles(bench: ModuleType) -> None:
    """100 requests of 1..100 ms: p50 50 ms, p99 99 ms. With the two slowest failed instead,
    p50 is unchanged and p99 is reached by a failure: infinite."""
    ms = [i / 1000 for i in range(1, 101)]
    answered = result(bench, "all resident", list(ms), held=64, configured=64)
    assert answered.ttft_percentile(50) == pytest.approx(0.050)
    assert answered.ttft_percentile(99) == pytest.approx(0.099)
    assert answered.failures == 0 and answered.unlisted == 0
    failing = result(bench, "fixed replicas", [*ms[:98], None, None], held=8, configured=8)
    assert failing.ttft_percentile(50) == pytest.approx(0.050)
    assert math.isinf(failing.ttft_percentile(99))
    assert (failing.failures, failing.unlisted) == (2, 2)


def test_the_table_and_the_target(bench: ModuleType) -> None:
    """Scaling at p99 150 ms with 8 slots against all-resident at 100 ms with 64 held: the
    target is met (1.5x, 1/8); at p99 250 ms, or holding 32 slots, it is not."""
    resident = result(bench, "all resident", [0.1] * 100, held=64, configured=64)
    scaling = result(bench, "scaling", [0.15] * 100, held=8, configured=8)
    check = bench.target_check(scaling, resident)
    assert (check.p99_ratio, check.slot_ratio, check.met) == (pytest.approx(1.5), 0.125, True)
    assert "target" in bench.target_line(check) and ": met:" in bench.target_line(check)
    slow = bench.target_check(result(bench, "scaling", [0.25] * 100, held=8, configured=8), resident)
    assert (slow.p99_ratio, slow.met) == (pytest.approx(2.5), False)
    assert "NOT met" in bench.target_line(slow)
    assert not bench.target_check(result(bench, "scaling", [0.15] * 100, held=8, configured=32), resident).met
    failed = bench.target_check(result(bench, "scaling", [0.15] * 98 + [None, None], held=8, configured=8), resident)
    assert math.isinf(failed.p99_ratio) and not failed.met

    fixed = result(bench, "fixed replicas", [0.01] * 90 + [None] * 10, held=8, configured=8)
    lines = bench.table([scaling, fixed, resident]).splitlines()
    assert len(lines) == 4 and lines[0].split()[:3] == ["mode", "p50", "ms"]
    assert lines[1].split() == ["scaling", "150.0", "150.0", "100", "0", "0", "3", "1", "8", "8"]
    assert lines[2].split() == ["fixed", "replicas", "10.0", "failed", "100", "10", "10", "3", "1", "8", "8"]
    assert lines[3].split()[:4] == ["all", "resident", "100.0", "100.0"]


def test_the_quick_flag_shortens_the_run(bench: ModuleType) -> None:
    quick, full = bench.parse_args(["--quick"]), bench.parse_args([])
    assert (quick.slots, quick.requests) == (2, 100)
    assert (full.slots, full.requests) == (4, 400)
    assert bench.parse_args(["--quick", "--slots", "3"]).slots == 3
