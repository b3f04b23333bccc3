"""Engine benchmarks, each printed side by side from one run:

(a) loading one adapter on a tp=4 engine (`Engine.load_adapter`, all ranks): one whose config
    and header bytes the engine validated before (every adapter of one training recipe after the
    first: the driver's spec memo, `adapters.memo.SpecMemo`), one with a config new to it beside a
    header it has seen (the same recipe, other metadata in the config: the memo's second level),
    and one whose config and header are both new to it (the first adapter of a recipe); the
    validation the driver does once for it, and what one rank does (read its shard of the verified files; one
    process), vs reading the same file once; the load's CPU time (the driver's thread and the
    ranks' main threads) and the wall-time floor it sets on this machine's cores, every load
    timed right after a read of the file in the same loop (read, load, read, load ...), the kinds
    of load alternating, so that each ratio compares figures taken in the same seconds; the bytes
    each rank reads per load (its shard's rows, from the page cache: no rank hashes the file);
    the load with the caller's digests: of files still as the agent wrote them (the agent's path:
    the driver compares their identities with those the agent recorded) and of other versions
    (the driver hashes both files once);
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
import pickle
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lorafleet_dev.synthetic import BENCHMARK_MODEL, write_adapter, write_model
from node_agent.engine import Engine, EngineConfig, FileIdentity, SequenceInput, Topology, WrittenFiles
from node_agent.engine.adapters.errors import CONFIG_FILE, WEIGHTS_FILE
from node_agent.engine.adapters.files import FileDigests, HeldFiles, VerifiedAdapter, verify_adapter
from node_agent.engine.adapters.memo import SpecMemo
from node_agent.engine.adapters.plan import plan_shard
from node_agent.engine.adapters.reads import read_planned_shard
from node_agent.engine.driver.protocol import Load
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.parallel.sharding import LoraSliceLayout, ModuleKey, lora_layout, model_kinds, module_layout

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


def rank_cpu(pids: list[int]) -> list[float]:
    """CPU seconds each rank's main thread (where commands run) used so far, from
    /proc/PID/schedstat (nanoseconds, Linux; /proc/PID/stat counts in 10-ms ticks)."""
    return [int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9 for pid in pids]


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


def as_written(adapter: Path) -> WrittenFiles:
    """The files' identities, as the agent records them once it has written and hashed a snapshot."""
    return WrittenFiles(*(FileIdentity.of(os.stat(adapter / name)) for name in (WEIGHTS_FILE, CONFIG_FILE)))


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


def config_variants(root: Path, adapter: Path, count: int, new_headers: bool = False) -> list[Path]:
    """`count` copies of the adapter, each config with its own `revision` (a PEFT field the
    engine ignores): config bytes no spec memo has seen. The weights are hard-linked (a header
    the memo has seen) or, with `new_headers`, written again with their own metadata (the same
    tensors behind a header no memo has seen)."""
    tensors = load_file(adapter / WEIGHTS_FILE) if new_headers else {}
    variants = []
    for index in range(count):
        variant = root / f"{'recipe' if new_headers else 'config'}-{index}"
        variant.mkdir()
        if new_headers:
            save_file(tensors, variant / WEIGHTS_FILE, metadata={"format": "pt", "bench": str(index)})
        else:
            os.link(adapter / WEIGHTS_FILE, variant / WEIGHTS_FILE)
        text = (adapter / CONFIG_FILE).read_text().replace("{", f'{{\n  "revision": "bench-{index}",', 1)
        (variant / CONFIG_FILE).write_text(text)
        variants.append(variant)
    return variants


@dataclass
class Paired:
    """One kind of load, each timed right after a read of the file in the same loop (read, load,
    read, load ...), so that a ratio compares figures taken in the same seconds: wall times, the
    read's CPU, the load's CPU in the driver's calling thread and in each rank's main thread."""

    reads: list[float] = field(default_factory=list)
    read_cpu: list[float] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)
    driver: list[float] = field(default_factory=list)
    ranks: list[list[float]] = field(default_factory=list)  # per load, per rank

    def add(self, engine: Engine, read: Callable[[], object], load: Callable[[], object]) -> None:
        """Read the file, then load (timed), then unload (not timed)."""
        start, cpu = time.perf_counter(), time.thread_time()
        read()
        self.read_cpu.append(time.thread_time() - cpu)
        self.reads.append(time.perf_counter() - start)
        before = time.thread_time(), rank_cpu(engine.pids)
        start = time.perf_counter()
        load()
        self.loads.append(time.perf_counter() - start)
        self.driver.append(time.thread_time() - before[0])
        self.ranks.append([after - then for after, then in zip(rank_cpu(engine.pids), before[1], strict=True)])
        engine.unload_adapter("bench")

    def line(self, label: str) -> str:
        """Medians: the load, the read beside it, their ratio, the median of each pair's ratio, and
        the load's CPU (driver / each rank / the floor it sets on this machine's cores, over the
        read's CPU)."""
        load, read = statistics.median(self.loads), statistics.median(self.reads)
        pairs = statistics.median(a / b for a, b in zip(self.loads, self.reads, strict=True))
        driver = statistics.median(self.driver)
        per_rank = [statistics.median(column) for column in zip(*self.ranks, strict=True)]
        ranks = statistics.median(sum(row) for row in self.ranks)
        cores = os.cpu_count() or 1
        floor = driver + ranks / min(cores, len(per_rank))
        return (
            f"{label:<34}{load * 1e3:>8.2f} ms   read {read * 1e3:.2f} ms   ratio {load / read:.2f}x"
            f" (per pair {pairs:.2f}x)\n{'':<34}CPU driver {driver * 1e3:.2f} ms, ranks "
            f"{' / '.join(f'{c * 1e3:.2f}' for c in per_rank)} ms (sum {ranks * 1e3:.2f}); floor on {cores} cores "
            f"{floor * 1e3:.2f} ms = {floor / statistics.median(self.read_cpu):.2f}x the read's CPU"
        )


def bench_load(root: Path, model: Path, adapter: Path, repeats: int) -> None:
    file_bytes = (adapter / "adapter_model.safetensors").stat().st_size

    def read(directory: Path = adapter) -> object:
        return load_file(str(directory / WEIGHTS_FILE))

    read_once = timed(read, repeats)
    cfg = ModelConfig.from_dir(model)
    layouts = rank_layouts(cfg, Topology(4, 1), 0)
    validate_once = timed(lambda: verify_adapter(adapter, SpecMemo(cfg, RANK), None), repeats)
    seen = SpecMemo(cfg, RANK)
    validate_seen = timed(lambda: verify_adapter(adapter, seen, None), repeats)
    verified = verify_adapter(adapter, seen, None)
    rank_once = timed(lambda: rank_read(verified, layouts), repeats)
    hash_once = timed(lambda: file_digests(adapter), repeats)
    configs, recipes = config_variants(root, adapter, repeats), config_variants(root, adapter, repeats, new_headers=True)
    os.sync()  # the new files written back now, not by a kernel thread during the timed loads
    digests, written = file_digests(adapter), as_written(adapter)
    with Engine(EngineConfig(model_dir=model, topology=Topology(4, 1), max_lora_rank=RANK)) as engine:
        # Memory from the engine's first load: later loads reuse the heap the unloads freed.
        first = engine.load_adapter("bench", adapter).ranks
        # A second adapter beside it lands in new memory too, without the first load's one-time growth.
        second = engine.load_adapter("bench-2", adapter).ranks
        engine.unload_adapter("bench-2")
        engine.unload_adapter("bench")
        reads: list[list[int]] = [[] for _ in engine.pids]
        # What a rank's pipe delivers for a load: its pickled command (as the driver sends it) and its length.
        plans = tuple(plan_shard(verified.spec, rank_layouts(cfg, Topology(4, 1), rank), torch.float32) for rank in range(4))
        command_bytes = [len(pickle.dumps(Load("bench", verified.files, plan, False), pickle.HIGHEST_PROTOCOL)) + 4 for plan in plans]
        seen_loads, config_loads, new_loads, hashed_loads, agent_loads = Paired(), Paired(), Paired(), Paired(), Paired()
        # The kinds alternate load by load, each after its own read: one kind never runs in a
        # quieter minute than another.
        for config, recipe in zip(configs, recipes, strict=True):
            read_before = rank_read_chars(engine.pids)
            seen_loads.add(engine, read, lambda: engine.load_adapter("bench", adapter))
            for rank_reads, after, before, command in zip(reads, rank_read_chars(engine.pids), read_before, command_bytes, strict=True):
                rank_reads.append(after - before - command)
            config_loads.add(engine, read, lambda config=config: engine.load_adapter("bench", config))
            # Its own file, read just before it as every other kind's file is.
            new_loads.add(engine, lambda recipe=recipe: read(recipe), lambda recipe=recipe: engine.load_adapter("bench", recipe))
            hashed_loads.add(engine, read, lambda: engine.load_adapter("bench", adapter, expected=digests))
            agent_loads.add(engine, read, lambda: engine.load_adapter("bench", adapter, expected=digests, written=written))
    print(f"\n(a) adapter load, rank {RANK}, all 7 modules x {SHAPE.num_layers} layers, file {file_bytes / 2**20:.2f} MiB")
    print(f"{'read file once (1 process)':<34}{read_once * 1e3:>8.2f} ms   (alone, before the loads)")
    print(
        f"{'validation, once (the driver)':<34}{validate_once * 1e3:>8.2f} ms   ratio {validate_once / read_once:.2f}x"
        f"   (bytes validated before: {validate_seen * 1e3:.2f} ms)"
    )
    print(f"{'one rank reads its shard':<34}{rank_once * 1e3:>8.2f} ms   ratio {rank_once / read_once:.2f}x")
    print("Engine.load_adapter, tp=4, each load right after a read of the file (medians):")
    print(seen_loads.line("  config and header seen before"))
    print(config_loads.line("  a new config, header seen before"))
    print(new_loads.line("  bytes new to the engine"))
    print(hashed_loads.line("  with digests, files hashed") + f"; hashing both files alone {hash_once * 1e3:.2f} ms")
    print(agent_loads.line("  with digests, as written (agent)"))
    print(
        f"{'rank':<6}{'shard MiB':>12}{'peak RSS growth MiB':>22}{'growth / shard':>16}{'shard / file':>14}"
        "   (first load; second load beside it)"
    )
    for reply, beside, rank_reads in zip(first, second, reads, strict=True):
        shard, growth, then = reply.shard_bytes, reply.peak_rss_growth_bytes, beside.peak_rss_growth_bytes
        read_bytes = statistics.median(rank_reads)
        print(
            f"{reply.rank:<6}{shard / 2**20:>12.2f}{growth / 2**20:>10.2f}; {then / 2**20:>.2f}"
            f"{growth / shard:>10.2f}; {then / shard:.2f}{shard / file_bytes:>14.2f}"
            f"   reads {read_bytes / 2**20:.2f} MiB of the file per load ({read_bytes / file_bytes:.2f} of it)"
        )
    peak, shard_bytes = loader_peak(adapter, cfg, layouts)
    print(
        f"{'loader peak allocation, rank 0':<34}{peak / 2**20:>8.2f} MiB   {peak / shard_bytes:.2f}x its shard "
        f"({shard_bytes / 2**20:.2f} MiB)"
    )


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
