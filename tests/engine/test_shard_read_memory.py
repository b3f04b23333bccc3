"""A rank's first shard read grows its memory by the shard alone once the reader is warmed up.

Each measurement runs in a freshly spawned interpreter, as a rank process is one: the first
call of a kernel maps its code into the process (file-backed pages that count in RSS and in the
peak the engine reports per load), so only a process that has never read a shard shows it.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import pytest
import torch

from lorafleet_dev.synthetic import SyntheticModel, write_adapter, write_model
from node_agent.engine.adapters.errors import WEIGHTS_FILE
from node_agent.engine.adapters.plan import plan_shard
from node_agent.engine.adapters.reads import read_planned_shard, warm_up_shard_reads
from node_agent.engine.adapters.spec import read_adapter_spec
from node_agent.engine.driver.config import EngineConfig
from node_agent.engine.driver.engine import Engine
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.parallel.sharding import lora_layout, model_kinds, module_layout
from node_agent.engine.parallel.topology import Topology

# A shard of about 2.6 MiB on rank 0 of tp=2 (the benchmark's is 2.4 MiB), on a model small
# enough to write in a moment; tp=2 makes the row-parallel A reads column slices.
SHAPE = SyntheticModel(hidden_size=256, intermediate_size=704, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64)
RANK = 128
TOPOLOGY = Topology(2, 1)


@dataclass(frozen=True)
class ReadMemory:
    """One first shard read in a fresh process: its bytes and what it grew."""

    shard_bytes: int
    peak_growth_bytes: int  # the peak RSS (VmHWM) during the read, over the RSS before it
    file_backed_growth_bytes: int  # RssFile after the read, over RssFile before it


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise LookupError(field)


def first_read(model_dir: Path, adapter_dir: Path, warm_up: bool) -> ReadMemory:
    """In this (fresh) process: optionally warm the reader up, then read rank 0's shard once,
    by a plan made before (the driver makes it, not the rank)."""
    torch.set_num_threads(1)  # as a CPU rank on a machine with fewer cores than ranks
    cfg = ModelConfig.from_dir(model_dir)
    spec = read_adapter_spec(adapter_dir, cfg, RANK)
    layouts = {
        (layer, kind): lora_layout(module_layout(cfg, TOPOLOGY, 0, kind), RANK, False)
        for layer in range(cfg.num_layers)
        for kind in model_kinds(cfg)
    }
    plan = plan_shard(spec, layouts, torch.float32)
    if warm_up:
        warm_up_shard_reads(torch.float32)
    fd = os.open(adapter_dir / WEIGHTS_FILE, os.O_RDONLY)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # the peak mark starts again from the RSS now
        rss, file_backed = _status_kib("VmRSS"), _status_kib("RssFile")
        shard = read_planned_shard(plan, fd, tuple(layouts), torch.float32)
        peak, file_after = _status_kib("VmHWM"), _status_kib("RssFile")
    finally:
        os.close(fd)
    return ReadMemory(shard.nbytes, (peak - rss) * 1024, (file_after - file_backed) * 1024)


def in_fresh_process(model_dir: Path, adapter_dir: Path, warm_up: bool) -> ReadMemory:
    """`first_read` in a newly spawned interpreter."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(first_read, model_dir, adapter_dir, warm_up).result()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("shard-memory")
    return write_model(root / "model", SHAPE), write_adapter(root / "adapter", SHAPE, rank=RANK)


def test_after_the_warm_up_a_first_read_grows_memory_by_about_its_shard(files):
    read = in_fresh_process(*files, warm_up=True)
    assert read.shard_bytes > 2 << 20, "the shard is large enough for the ratio to mean something"
    assert read.peak_growth_bytes <= 1.2 * read.shard_bytes, read
    assert read.file_backed_growth_bytes < 64 << 10, f"no kernel code is mapped by the load itself: {read}"


def test_without_the_warm_up_a_first_read_maps_kernel_code_beyond_the_target(files):
    """What the warm-up takes out of the first load: without it, the first read grows by more than its shard."""
    read = in_fresh_process(*files, warm_up=False)
    assert read.peak_growth_bytes > 1.2 * read.shard_bytes, read
    assert read.file_backed_growth_bytes > 0.2 * read.shard_bytes, f"the excess is code pages mapped by the read: {read}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_warm_up_reads_files_of_every_float_dtype_into_the_engines_dtype(dtype):
    shard = warm_up_shard_reads(dtype)
    slices = [part for parts in shard.weights.values() for part in parts if part is not None]
    assert len(slices) == 8, "two modules per file dtype (F64, F32, F16, BF16)"
    for part in slices:
        assert part.a.dtype == part.b.dtype == dtype
        assert not part.a.any() and not part.b.any()
    assert shard.nbytes == sum(part.a.numel() + part.b.numel() for part in slices) * dtype.itemsize


def test_an_engines_first_load_grows_each_ranks_peak_by_about_its_shard(files):
    """The ranks warm the reader up at start-up: the first load a rank reports (peak_rss_growth_bytes)
    is its shard, not the shard plus the reader's kernel code (1.6x before the worker called it)."""
    model_dir, adapter_dir = files
    with Engine(EngineConfig(model_dir=model_dir, topology=TOPOLOGY, max_lora_rank=RANK)) as engine:
        result = engine.load_adapter("first", adapter_dir)
    assert result.ok and len(result.ranks) == TOPOLOGY.tp_size, result
    for reply in result.ranks:
        assert reply.shard_bytes > 2 << 20, reply
        assert reply.peak_rss_growth_bytes <= 1.2 * reply.shard_bytes, (reply.rank, reply.shard_bytes, reply.peak_rss_growth_bytes)
