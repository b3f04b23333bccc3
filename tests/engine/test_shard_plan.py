"""The driver plans every rank's shard read at once (`ShardPlanner`); a rank carries its plan out.

The numeric tests (test_sharding_layout, test_equivalence, test_moe, test_deepseek) check what
the plans read; these check that planning all ranks together gives each rank the plan it would
get alone, that a plan joins a rank's row runs into few reads, zeroes its buffer only where
its reads leave bytes unwritten, travels as one bytes object, and is made once per content.
"""

from __future__ import annotations

import dataclasses
import os
import pickle

import numpy as np
import pytest
import torch

from lorafleet_dev.synthetic import SyntheticModel, write_adapter, write_model
from node_agent.engine.adapters.errors import WEIGHTS_FILE
from node_agent.engine.adapters.plan import ShardPlan, ShardPlanner, plan_shard
from node_agent.engine.adapters.reads import read_planned_shard
from node_agent.engine.adapters.spec import read_adapter_spec
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.parallel.sharding import lora_layout, model_kinds, module_layout
from node_agent.engine.parallel.topology import Topology

MAX_RANK = 8
# Wide enough that a row-parallel A's column slice at tp=4 (128 floats) is read straight into its rows.
SHAPE = SyntheticModel(hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    root = tmp_path_factory.mktemp("shard-plan")
    cfg = ModelConfig.from_dir(write_model(root / "model", SHAPE))
    return cfg, {rank: write_adapter(root / f"r{rank}", SHAPE, rank=rank) for rank in (3, MAX_RANK)}


def rank_layouts(cfg: ModelConfig, topology: Topology, rank: int) -> dict:
    return {
        (layer, kind): lora_layout(module_layout(cfg, topology, rank, kind), MAX_RANK, topology.fully_sharded_loras)
        for layer in range(cfg.num_layers)
        for kind in model_kinds(cfg)
    }


def assert_same_plan(got: ShardPlan, want: ShardPlan) -> None:
    assert (got.numel, got.file_size, got.max_gap, got.tensors) == (want.numel, want.file_size, want.max_gap, want.tensors)
    for field in ("calls", "segments", "staged", "slices", "scales"):
        assert getattr(got, field).tolist() == getattr(want, field).tolist(), field


@pytest.mark.parametrize("adapter_rank", [3, MAX_RANK])
@pytest.mark.parametrize("fully_sharded", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planning_every_rank_at_once_gives_each_rank_its_own_plan(adapter, adapter_rank, fully_sharded, dtype):
    cfg, paths = adapter
    spec = read_adapter_spec(paths[adapter_rank], cfg, MAX_RANK)
    topology = Topology(4, 1, fully_sharded_loras=fully_sharded)
    layouts = [rank_layouts(cfg, topology, rank) for rank in range(4)]
    plans = ShardPlanner(layouts, dtype).plans(spec)
    assert len(plans) == 4
    for rank, plan in enumerate(plans):
        assert_same_plan(plan, plan_shard(spec, layouts[rank], dtype))
        fd = os.open(paths[adapter_rank] / WEIGHTS_FILE, os.O_RDONLY)
        try:
            shard = read_planned_shard(plan, fd, tuple(layouts[rank]), dtype)
        finally:
            os.close(fd)
        assert shard.nbytes == plan.numel * dtype.itemsize
        assert len(shard.weights) == len(layouts[rank])


def test_a_plan_joins_a_ranks_row_runs_into_few_reads(adapter):
    """At tp=4 each row-parallel A is a column slice: one run per row, joined with the rows'
    other columns between them (read into scratch) into one preadv per stretch of the file."""
    cfg, paths = adapter
    spec = read_adapter_spec(paths[MAX_RANK], cfg, MAX_RANK)
    topology = Topology(4, 1)
    plan = ShardPlanner([rank_layouts(cfg, topology, rank) for rank in range(4)], torch.float32).plans(spec)[1]
    runs = int((plan.segments[:, 0] >= 0).sum())
    blocks = 2 * len(plan.slices)
    assert runs > blocks, "the column slices are read row by row"
    assert len(plan.calls) < blocks / 2, (len(plan.calls), blocks)
    assert len(plan.staged) == 0, "every block of a same-dtype file is read straight into the shard"
    assert plan.max_gap > 0


@pytest.mark.parametrize("adapter_rank", [3, MAX_RANK])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_plan_zeroes_its_buffer_exactly_when_its_reads_leave_bytes_unwritten(adapter, adapter_rank, dtype):
    """The reads of an adapter of the engine's max rank write every byte of the buffer (read
    straight in or converted through staging): it is not zeroed first. Rank padding (a lower
    rank) leaves bytes no read touches: the buffer then starts zeroed."""
    cfg, paths = adapter
    spec = read_adapter_spec(paths[adapter_rank], cfg, MAX_RANK)
    topology = Topology(4, 1)
    for plan in ShardPlanner([rank_layouts(cfg, topology, rank) for rank in range(4)], dtype).plans(spec):
        written = np.zeros(plan.numel * dtype.itemsize, dtype=np.int64)
        for begin, size in plan.segments.tolist():
            if begin >= 0:
                written[begin : begin + size] += 1
        for _, rows, _, _, _, cols, _, offset, dest_cols in plan.staged.tolist():
            for row in range(rows):
                start = (offset + row * dest_cols) * dtype.itemsize
                written[start : start + cols * dtype.itemsize] += 1
        assert written.max() <= 1, "no byte is written twice"
        assert plan.zeroed == (not written.all())
        assert plan.zeroed == (adapter_rank < MAX_RANK), "a same-dtype file of max rank fills the buffer whole"


def test_a_plan_travels_as_one_bytes_object(adapter):
    """A plan pickles to one bytes object and back to the same plan (what a rank's Load carries)."""
    cfg, paths = adapter
    spec = read_adapter_spec(paths[3], cfg, MAX_RANK)
    for plan in ShardPlanner([rank_layouts(cfg, Topology(4, 1), rank) for rank in range(4)], torch.bfloat16).plans(spec):
        back = pickle.loads(pickle.dumps(plan))
        assert_same_plan(back, plan)
        assert back.zeroed == plan.zeroed


def test_the_planner_remembers_the_plans_of_a_specs_content(adapter):
    """Specs of equal content (`AdapterSpec.content`) are planned once; a spec made by hand
    (no content) is planned every time."""
    cfg, paths = adapter
    spec = read_adapter_spec(paths[3], cfg, MAX_RANK)
    planner = ShardPlanner([rank_layouts(cfg, Topology(4, 1), rank) for rank in range(4)], torch.float32)
    plans = planner.plans(spec)
    assert planner.plans(read_adapter_spec(paths[3], cfg, MAX_RANK)) is plans
    unnamed = dataclasses.replace(spec, content="")
    assert planner.plans(unnamed) is not planner.plans(unnamed)
