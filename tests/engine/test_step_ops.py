"""A decode step's op budget on the CPU (docs/serving.md, "Where a decode step's time goes").

On the CPU a small decode step is bound by the number of torch ops it dispatches, beside its
weight reads: each costs a few microseconds whatever its size. This counts, without any clock,
the aten ops of one decode step of one sequence with one adapter on a tiny model (tp 1, every
module LoRA-targeted) and holds it to a budget, so that per-module overhead cannot creep back
unnoticed. Raise the budget only for a deliberate change.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lorafleet_dev.synthetic import SyntheticModel, write_model
from node_agent.engine.checkpoint import Checkpoint
from node_agent.engine.distributed import ProcessGroups
from node_agent.engine.kernels import LoraBatch
from node_agent.engine.kv_cache import PagedKVCache, kv_cache_layout
from node_agent.engine.lora_layers import LoraCapacity, SliceWeights
from node_agent.engine.model import AttentionBatch, CausalLM, ForwardContext, block_table_tensor
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.sampler import SamplingParams, SequenceSampling, sample
from node_agent.engine.sharding import ShardGroup
from node_agent.engine.topology import Topology

LAYERS = 2
BLOCK = 4
# Measured on this two-layer model: 344 ops on 2026-12-01 (612 before 8ad9993 and ae72171), 234
# on 2026-12-02 with the fused fp32 LoRA pass, the index_select KV gather and the segments built
# in Python (342 for the code before them); 210 later that day: the lone sequence's context read
# as a view of its consecutive blocks, no split for one-slice modules, no `to` where the dtype
# already is the target (234 for the code before). The budget leaves a little room.
OPS_BUDGET = 225


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("ops") / "model", SyntheticModel(num_layers=LAYERS))


def context(model: CausalLM, kv: PagedKVCache, tokens: int, position: int, slot: int) -> ForwardContext:
    """One sequence's forward context as a rank builds it (worker.RankWorker._context)."""
    slots = list(range(position, position + tokens))
    cos, sin = model.rope_tables(slots)
    lora = LoraBatch.from_token_slots(torch.full((tokens,), slot, dtype=torch.int64))
    blocks = list(range(-(-(position + tokens) // BLOCK)))
    attention = AttentionBatch(kv, torch.tensor(slots), block_table_tensor([blocks], torch.device("cpu")), [tokens],
                               [position + tokens])
    return ForwardContext([tokens], 0, 0, lora, lora, cos, sin, attention, torch.tensor([tokens - 1]))


def test_one_decode_step_stays_within_its_op_budget(model_dir: Path) -> None:
    cfg = ModelConfig.from_dir(model_dir)
    topology, cpu = Topology(1, 1), torch.device("cpu")
    groups = ProcessGroups(dict.fromkeys(ShardGroup))
    model = CausalLM(cfg, topology, 0, groups, LoraCapacity(16, 4, False), torch.float32, cpu)
    model.load_base(Checkpoint(model_dir))
    gen = torch.Generator().manual_seed(0)
    modules = model.lora_modules()
    for module in modules.values():  # every module targeted by the adapter in slot 1
        module.set_slot(1, [SliceWeights(torch.randn(a, generator=gen), torch.randn(b, generator=gen), 0.5)
                            for a, b in module.slot_shapes()])
    for module in modules.values():  # on the CPU each slot's B is column-major (docs/kernels.md)
        for stack in getattr(module, "b_stacks", []):
            assert stack[1].stride() == (1, stack.shape[1]), "B of a slot should be held transposed"
    kv = PagedKVCache.from_budget(kv_cache_layout(cfg, topology, 0, BLOCK, torch.float32), 1 << 20, cpu)
    prompt = torch.arange(1, 7)
    model(prompt, context(model, kv, len(prompt), 0, 1))
    row = SequenceSampling(SamplingParams(), seed=0, index=0)
    counter = OpCounter()
    with counter:
        logits = model(torch.tensor([7]), context(model, kv, 1, len(prompt), 1))
        sample(logits, [row])
    total = sum(counter.ops.values())
    assert total <= OPS_BUDGET, f"{total} ops in one decode step, budget {OPS_BUDGET}: {counter.ops.most_common(12)}"
    # A lone sequence on consecutive blocks (this one's: 0, 1) attends through a view of them.
    assert counter.ops["aten.index_select.default"] == 0, "the decode gathered a context it could view"
