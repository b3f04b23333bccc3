"""Engine benchmarks (issue 2), each printed side by side from one run:

(a) loading one adapter on a tp=4 engine vs reading the same file once in one process, and each
    rank's peak memory growth during the load vs the bytes of its shard;
(b) a forward with 8 distinct adapters in the batch vs the same forward with no adapter, on a
    generated model of hidden size 1024 with 4 layers.

Run: `. scripts/bootstrap.sh && python benchmarks/bench_engine.py [--repeats N]`.
CPU timings on a shared machine are noisy: read the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file

from lorafleet_dev.synthetic import BENCHMARK_MODEL, write_adapter, write_model
from node_agent.engine import Engine, EngineConfig, SequenceInput, Topology

SHAPE = BENCHMARK_MODEL
RANK = 16


def timed(function, repeats: int) -> float:
    """Median seconds of `repeats` calls."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench_load(root: Path, model: Path, adapter: Path, repeats: int) -> None:
    file_bytes = (adapter / "adapter_model.safetensors").stat().st_size
    read_once = timed(lambda: load_file(str(adapter / "adapter_model.safetensors")), repeats)
    with Engine(EngineConfig(model_dir=model, topology=Topology(4, 1), max_lora_rank=RANK)) as engine:
        samples, replies = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            replies = engine.load_adapter("bench", adapter)
            samples.append(time.perf_counter() - start)
            engine.unload_adapter("bench")
        load_tp4 = statistics.median(samples)
    print(f"\n(a) adapter load, rank {RANK}, all 7 modules x {SHAPE.num_layers} layers, file {file_bytes / 2**20:.2f} MiB")
    print(f"{'read file once (1 process)':<34}{read_once * 1e3:>10.1f} ms")
    print(f"{'LoadAdapter on tp=4 (all ranks)':<34}{load_tp4 * 1e3:>10.1f} ms   ratio {load_tp4 / read_once:.2f}x")
    print(f"{'rank':<6}{'shard MiB':>12}{'peak RSS growth MiB':>22}{'growth / shard':>16}{'shard / file':>14}")
    for reply in replies:
        shard, growth = reply.payload["shard_bytes"], reply.payload["peak_rss_growth_bytes"]
        print(f"{reply.rank:<6}{shard / 2**20:>12.2f}{growth / 2**20:>22.2f}{growth / shard:>16.2f}{shard / file_bytes:>14.2f}")


def bench_forward(root: Path, model: Path, repeats: int) -> None:
    adapters = {f"a{i}": write_adapter(root / f"a{i}", SHAPE, rank=RANK, seed=i) for i in range(8)}
    config = EngineConfig(model_dir=model, topology=Topology(2, 1), max_lora_rank=RANK, max_loras_per_batch=8)
    tokens = [[(7 * i + j) % SHAPE.vocab_size for j in range(32)] for i in range(8)]
    with Engine(config) as engine:
        for name, path in adapters.items():
            engine.load_adapter(name, path)
        base = [SequenceInput(t) for t in tokens]
        mixed = [SequenceInput(t, f"a{i}") for i, t in enumerate(tokens)]
        engine.forward(mixed)  # warm up: make every adapter resident
        t_base = timed(lambda: engine.forward(base), repeats)
        t_mixed = timed(lambda: engine.forward(mixed), repeats)
    print(f"\n(b) forward, tp=2, 8 sequences x 32 tokens, hidden {SHAPE.hidden_size}, {SHAPE.num_layers} layers, rank {RANK}")
    print(f"{'no adapter':<34}{t_base * 1e3:>10.1f} ms")
    print(f"{'8 distinct adapters':<34}{t_mixed * 1e3:>10.1f} ms   ratio {t_mixed / t_base:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions per figure (median; default 5)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-") as tmp:
        root = Path(tmp)
        print(f"generating a {SHAPE.hidden_size}-hidden, {SHAPE.num_layers}-layer model and adapters in {root}")
        model = write_model(root / "model", SHAPE)
        adapter = write_adapter(root / "adapter", SHAPE, rank=RANK)
        bench_load(root, model, adapter, args.repeats)
        bench_forward(root, model, args.repeats)


if __name__ == "__main__":
    main()
