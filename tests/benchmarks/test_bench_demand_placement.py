"""The placement benchmark's `--dynamo` mode (benchmarks/bench_demand_placement.py): the request
path that stands in for Dynamo's simulated residency, Dynamo's workloads, and the replay of its
exported loads. Pure arithmetic on small synthetic inputs; no timing."""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_demand_placement.py"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script imported as a module from its folder, afresh for each test."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    monkeypatch.delitem(sys.modules, SCRIPT.stem, raising=False)
    return importlib.import_module(SCRIPT.stem)


def test_a_cold_request_loads_and_the_next_one_hits(bench: ModuleType) -> None:
    """The first request for an adapter is a miss that loads it; the next one on that worker is
    a hit; nothing is evicted while the worker has room."""
    path = bench.RequestPath()
    routes = {"a": frozenset({"worker-3"})}
    assert path.serve({"a": 1}, routes) == bench.Served(hits=0, loads=1, evictions=0)
    assert path.serve({"a": 1}, routes) == bench.Served(hits=1, loads=0, evictions=0)
    assert path.resident["worker-3"] == ["a"]


def test_requests_prefer_replicas_holding_the_adapter(bench: ModuleType) -> None:
    """With two replica workers of which one holds the adapter, every request goes to that one:
    all hits, no second load."""
    path = bench.RequestPath()
    path.resident["worker-1"].append("a")
    served = path.serve({"a": 5}, {"a": frozenset({"worker-1", "worker-2"})})
    assert served == bench.Served(hits=5, loads=0, evictions=0)
    assert "a" not in path.resident["worker-2"]


def test_an_adapter_without_replicas_goes_where_it_is_held_else_anywhere_in_turn(bench: ModuleType) -> None:
    """No route: the first request of a tick loads it on the cursor's worker, later ones follow
    it there; when no worker holds it, the cursor moves on to the next worker."""
    path = bench.RequestPath()
    assert path.serve({"a": 3}, {}) == bench.Served(hits=2, loads=1, evictions=0)
    assert [pod for pod, held in path.resident.items() if "a" in held] == ["worker-0"]
    path.resident["worker-0"].clear()
    path.serve({"a": 1}, {})
    assert [pod for pod, held in path.resident.items() if "a" in held] == ["worker-3"]


def test_a_full_worker_evicts_its_least_recently_used_adapter(bench: ModuleType) -> None:
    """Slots full of a, b, c, d (a used last): loading e evicts b, the least recently used."""
    path = bench.RequestPath()
    path.resident["worker-0"].extend(["a", "b", "c", "d"])
    path.serve({"a": 1}, {"a": frozenset({"worker-0"})})
    served = path.serve({"e": 1}, {"e": frozenset({"worker-0"})})
    assert served == bench.Served(hits=0, loads=1, evictions=1)
    assert path.resident["worker-0"] == ["c", "d", "a", "e"]


def test_dynamo_workloads_follow_its_rate_envelopes(bench: ModuleType) -> None:
    """Zipf + Poisson is flat at 40; the daily envelope runs from 10 at midnight to 50 at noon;
    a spike multiplies 25 by 5 at tick 50 and halves its excess every 8 ticks; MMPP starts calm
    and only ever takes its three rates."""
    rng = np.random.default_rng(0)
    assert set(bench.dynamo_total_rates("hot_lora_poisson", rng)) == {40.0}
    daily = bench.dynamo_total_rates("daily", rng)
    assert math.isclose(daily[0], 10.0) and math.isclose(daily[50], 50.0) and math.isclose(daily[100], 10.0)
    spike = bench.dynamo_total_rates("spike", rng)
    assert spike[49] == 25.0 and math.isclose(spike[50], 125.0) and math.isclose(spike[58], 75.0)
    mmpp = bench.dynamo_total_rates("mmpp", rng)
    assert mmpp[0] == 15.0 and set(mmpp) <= {15.0, 40.0, 70.0} and len(set(mmpp)) > 1
    with pytest.raises(ValueError, match="unknown Dynamo workload 'weekly'"):
        bench.dynamo_total_rates("weekly", rng)


def test_a_dynamo_trace_is_seeded_and_skewed(bench: ModuleType) -> None:
    """The same seed gives the same loads, another seed others; the top adapter gets about
    40 / H(100) ≈ 7.7 requests per tick and far more than the hundredth."""
    trace = bench.dynamo_trace("hot_lora_poisson", 3)
    assert trace == bench.dynamo_trace("hot_lora_poisson", 3)
    assert trace != bench.dynamo_trace("hot_lora_poisson", 4)
    top = sum(t["lora-000"] for t in trace) / len(trace)
    assert 6.5 < top < 9.0
    assert sum(t["lora-099"] for t in trace) < sum(t["lora-000"] for t in trace) / 20


def test_an_exported_trace_reads_back_with_absent_adapters_at_zero(bench: ModuleType, tmp_path: Path) -> None:
    """Dynamo's export has a column per adapter that was ever requested, beside its totals."""
    exported = tmp_path / "hot_lora_poisson_load.csv"
    exported.write_text("tick,total_load,active_loras,lora-000,lora-007\n0,3,2,2,1\n1,0,0,0,0\n")
    trace = bench.read_trace(exported)
    assert len(trace) == 2 and len(trace[0]) == bench.ADAPTERS
    assert trace[0]["lora-000"] == 2 and trace[0]["lora-007"] == 1 and trace[0]["lora-001"] == 0
    assert sum(trace[1].values()) == 0
