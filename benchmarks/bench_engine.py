"""Engine benchmarks (issue 2), each printed side by side from one run:

(a) loading one adapter on a tp=4 engine (`Engine.load_adapter`, all ranks): one whose config
    and header bytes the engine validated before (every adapter of one training recipe after the
    first: the driver's spec memo, `peft_adapter.SpecMemo`) and one whose bytes are new to it; the
    validation the driver does once for it, and what one rank does (read its shard of the verified files; one
    process), vs reading the same file once; the load's CPU time (the driver's thread and the
    ranks' main threads) and the wall-time floor it sets on this machine's cores; the bytes
    each rank reads per load (its shard's rows, from the page cache: no rank hashes the file);
    the load with the caller's digests, as the agent loads (the driver then hashes both files once);
    each rank's peak RSS growth during the engine's first load and during a second one beside
    it (new memory too, without the first's one-time growth), and the loader's own peak
    allocation for one rank's shard (tracemalloc, one process), vs that shard;
(b) a forward with 8 distinct adapters in the batch vs the same forward with no adapter, on a
    generated model of hidden size 1024 with 4 layers.

Run: `. scripts/bootstrap.sh && python benchmarks/bench_engine.py [--repeats N] [--load-only]`.
CPU timings on a shared machine are noisy: read the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import tracemalloc
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
from safetensors.torch import load_file

from lorafleet_dev.synthetic import BENCHMARK_MODEL, write_adapter, write_model
from node_agent.engine import Engine, EngineConfig, SequenceInput, Topology
from node_agent.engine.adapter_files import FileDigests, HeldFiles, VerifiedAdapter, verify_adapter
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.peft_adapter import CONFIG_FILE, WEIGHTS_FILE, SpecMemo, plan_shard, read_planned_shard
from node_agent.engine.protocol import Load
from node_agent.engine.sharding import LoraSliceLayout, ModuleKey, lora_layout, model_kinds, module_layout

SHAPE = BENCHMARK_MODEL
RANK = 16


def timed(function, repeats: int, clock=time.perf_counter) -> float:
    """Median seconds of `repeats` calls, by `clock` (wall time unless told)."""
    samples = []
    for _ in range(repeats):
        start = clock()
        function()
        samples.append(clock() - start)
    return statistics.median(samples)


def rank_cpu_seconds(pids: list[int]) -> float:
    """CPU seconds the ranks' main threads (where commands run) used so far, from
    /proc/PID/schedstat (nanoseconds, Linux; /proc/PID/stat counts in 10-ms ticks)."""
    return sum(int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) for pid in pids) / 1e9


def rank_read_chars(pids: list[int]) -> list[int]:
    """Bytes each rank process has read so far through read system calls (`rchar` of
    /proc/PID/io: files and its command pipe alike, whether or not from the page cache)."""
    return [int(Path(f"/proc/{pid}/io").read_text().split("rchar:")[1].split()[0]) for pid in pids]


def rank_layouts(cfg: ModelConfig, topology: Topology, rank: int) -> dict[ModuleKey, tuple[LoraSliceLayout, ...]]:
    """Every LoRA module's slices on `rank`, as the rank's model allocates them."""
    return {
        (layer, kind): lora_layout(module_layout(cfg, topology, rank, kind), RANK, topology.fully_sharded_loras)
        for layer in range(cfg.num_layers)
        for kind in model_kinds(cfg)
    }


def read_rank_shard(adapter: Path, cfg: ModelConfig, layouts: dict[ModuleKey, tuple[LoraSliceLayout, ...]]) -> int:
    """Validate the adapter (the driver's part of a load), then read one rank's shard; its bytes."""
    return rank_read(verify_adapter(adapter, SpecMemo(cfg, RANK), None), layouts)


def rank_read(verified: VerifiedAdapter, layouts: dict[ModuleKey, tuple[LoraSliceLayout, ...]]) -> int:
    """One rank's part of a load, its plan included (the driver plans it): hold the verified
    files, read its shard by the plan; its bytes."""
    plan = plan_shard(verified.spec, layouts, torch.float32)
    with HeldFiles(verified.files.path, "rank 0") as held:
        held.require(verified.files)
        shard = read_planned_shard(plan, held.weights_fd, tuple(layouts), torch.float32)
        held.check_unchanged()
    return shard.nbytes


def file_digests(adapter: Path) -> FileDigests:
    """The sha256 of the adapter's two files, as the driver computes them when given digests."""
    with HeldFiles(adapter, "the benchmark") as held:
        return held.digests()


def loader_peak(adapter: Path, cfg: ModelConfig, layouts: dict[ModuleKey, tuple[LoraSliceLayout, ...]]) -> tuple[int, int]:
    """(traced peak bytes, shard bytes) of one rank's loader, in this process.

    The loader allocates through Python (tracemalloc sees it), so this counts exactly what a
    load allocates, whatever memory the rank's heap happens to have free already.
    """
    tracemalloc.start()
    shard = read_rank_shard(adapter, cfg, layouts)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak, shard


def config_variants(root: Path, adapter: Path, count: int) -> list[Path]:
    """`count` copies of the adapter, the weights hard-linked, each config with its own
    `revision` (a PEFT field the engine ignores): bytes no spec memo has seen."""
    variants = []
    for index in range(count):
        variant = root / f"variant-{index}"
        variant.mkdir()
        os.link(adapter / WEIGHTS_FILE, variant / WEIGHTS_FILE)
        text = (adapter / CONFIG_FILE).read_text().replace("{", f'{{\n  "revision": "bench-{index}",', 1)
        (variant / CONFIG_FILE).write_text(text)
        variants.append(variant)
    return variants


def bench_load(root: Path, model: Path, adapter: Path, repeats: int) -> None:
    file_bytes = (adapter / "adapter_model.safetensors").stat().st_size
    read_once = timed(lambda: load_file(str(adapter / "adapter_model.safetensors")), repeats)
    read_once_cpu = timed(lambda: load_file(str(adapter / "adapter_model.safetensors")), repeats, time.thread_time)
    cfg = ModelConfig.from_dir(model)
    layouts = rank_layouts(cfg, Topology(4, 1), 0)
    validate_once = timed(lambda: verify_adapter(adapter, SpecMemo(cfg, RANK), None), repeats)
    seen = SpecMemo(cfg, RANK)
    validate_seen = timed(lambda: verify_adapter(adapter, seen, None), repeats)
    verified = verify_adapter(adapter, seen, None)
    rank_once = timed(lambda: rank_read(verified, layouts), repeats)
    hash_once = timed(lambda: file_digests(adapter), repeats)
    with Engine(EngineConfig(model_dir=model, topology=Topology(4, 1), max_lora_rank=RANK)) as engine:
        # Memory from the engine's first load: later loads reuse the heap the unloads freed.
        first = engine.load_adapter("bench", adapter).ranks
        # A second adapter beside it lands in new memory too, without the first load's one-time growth.
        second = engine.load_adapter("bench-2", adapter).ranks
        engine.unload_adapter("bench-2")
        engine.unload_adapter("bench")
        samples, driver_cpu, ranks_cpu = [], [], []
        reads: list[list[int]] = [[] for _ in engine.pids]
        # What a rank's pipe delivers for a load: its pickled command (as the driver sends it) and its length.
        plans = tuple(plan_shard(verified.spec, rank_layouts(cfg, Topology(4, 1), rank), torch.float32) for rank in range(4))
        command_bytes = [len(ForkingPickler.dumps(Load("bench", verified.files, plan, False))) + 4 for plan in plans]
        for _ in range(repeats):
            cpu_before, read_before = (time.thread_time(), rank_cpu_seconds(engine.pids)), rank_read_chars(engine.pids)
            start = time.perf_counter()
            engine.load_adapter("bench", adapter)
            samples.append(time.perf_counter() - start)
            driver_cpu.append(time.thread_time() - cpu_before[0])
            ranks_cpu.append(rank_cpu_seconds(engine.pids) - cpu_before[1])
            for rank_reads, after, before, command in zip(reads, rank_read_chars(engine.pids), read_before, command_bytes,
                                                          strict=True):
                rank_reads.append(after - before - command)
            engine.unload_adapter("bench")
        new_samples, new_driver, new_ranks = [], [], []
        for variant in config_variants(root, adapter, repeats):
            cpu_before = time.thread_time(), rank_cpu_seconds(engine.pids)
            start = time.perf_counter()
            engine.load_adapter("bench", variant)
            new_samples.append(time.perf_counter() - start)
            new_driver.append(time.thread_time() - cpu_before[0])
            new_ranks.append(rank_cpu_seconds(engine.pids) - cpu_before[1])
            engine.unload_adapter("bench")
        digests = file_digests(adapter)
        hashed_samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            engine.load_adapter("bench", adapter, expected=digests)
            hashed_samples.append(time.perf_counter() - start)
            engine.unload_adapter("bench")
        load_tp4 = statistics.median(samples)
        load_hashed = statistics.median(hashed_samples)
        load_driver, load_ranks = statistics.median(driver_cpu), statistics.median(ranks_cpu)
        load_new = statistics.median(new_samples)
        new_cpu = statistics.median(new_driver), statistics.median(new_ranks)
    print(f"\n(a) adapter load, rank {RANK}, all 7 modules x {SHAPE.num_layers} layers, file {file_bytes / 2**20:.2f} MiB")
    print(f"{'read file once (1 process)':<34}{read_once * 1e3:>10.1f} ms")
    print(f"{'validation, once (the driver)':<34}{validate_once * 1e3:>10.1f} ms   ratio {validate_once / read_once:.2f}x"
          f"   (bytes validated before: {validate_seen * 1e3:.2f} ms)")
    print(f"{'one rank reads its shard':<34}{rank_once * 1e3:>10.1f} ms   ratio {rank_once / read_once:.2f}x")
    print(f"{'Engine.load_adapter, tp=4':<34}{load_tp4 * 1e3:>10.1f} ms   ratio {load_tp4 / read_once:.2f}x"
          "   (config and header validated before)")
    print(f"{'  bytes new to the engine':<34}{load_new * 1e3:>10.1f} ms   ratio {load_new / read_once:.2f}x"
          f"   (CPU: driver / four ranks {new_cpu[0] * 1e3:.2f} / {new_cpu[1] * 1e3:.2f} ms)")
    print(f"{'  with the digests (agent path)':<34}{load_hashed * 1e3:>10.1f} ms   ratio {load_hashed / read_once:.2f}x"
          f"   (hashing both files once: {hash_once * 1e3:.1f} ms)")
    # CPU time barely depends on other load on the machine; with the ranks sharing the cores,
    # the driver's part and the ranks' part spread over the cores bound the wall time from below.
    cores = os.cpu_count() or 1
    floor = load_driver + load_ranks / min(cores, 4)
    print(f"{'  its CPU: driver / four ranks':<34}{load_driver * 1e3:>10.2f} / {load_ranks * 1e3:.2f} ms; "
          f"floor on {cores} cores {floor * 1e3:.2f} ms ({floor / read_once_cpu:.2f}x the read's CPU time)")
    print(f"{'rank':<6}{'shard MiB':>12}{'peak RSS growth MiB':>22}{'growth / shard':>16}{'shard / file':>14}"
          "   (first load; second load beside it)")
    for reply, beside, rank_reads in zip(first, second, reads, strict=True):
        shard, growth, then = reply.shard_bytes, reply.peak_rss_growth_bytes, beside.peak_rss_growth_bytes
        read = statistics.median(rank_reads)
        print(f"{reply.rank:<6}{shard / 2**20:>12.2f}{growth / 2**20:>10.2f}; {then / 2**20:>.2f}"
              f"{growth / shard:>10.2f}; {then / shard:.2f}{shard / file_bytes:>14.2f}"
              f"   reads {read / 2**20:.2f} MiB of the file per load ({read / file_bytes:.2f} of it)")
    peak, shard = loader_peak(adapter, cfg, layouts)
    print(f"{'loader peak allocation, rank 0':<34}{peak / 2**20:>10.2f} MiB   {peak / shard:.2f}x its shard ({shard / 2**20:.2f} MiB)")


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
    parser.add_argument("--load-only", action="store_true", help="run (a) only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-") as tmp:
        root = Path(tmp)
        print(f"generating a {SHAPE.hidden_size}-hidden, {SHAPE.num_layers}-layer model and adapters in {root}")
        model = write_model(root / "model", SHAPE)
        adapter = write_adapter(root / "adapter", SHAPE, rank=RANK)
        bench_load(root, model, adapter, args.repeats)
        if not args.load_only:
            bench_forward(root, model, args.repeats)


if __name__ == "__main__":
    main()
