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
from node_agent.engine.kernels import LoraBatch
from node_agent.engine.model.checkpoint import Checkpoint
from node_agent.engine.model.context import AttentionBatch, ForwardContext, RankSetup, block_table_tensor
from node_agent.engine.model.decoder import CausalLM
from node_agent.engine.model.lora_layers import LoraCapacity, SliceWeights
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.parallel.distributed import ProcessGroups
from node_agent.engine.parallel.sharding import ShardGroup
from node_agent.engine.parallel.topology import Topology
from node_agent.engine.serving.kv_cache import PagedKVCache, kv_cache_layout
from node_agent.engine.serving.sampler import SamplingParams, SequenceSampling, sample

LAYERS = 2
BLOCK = 4
# A CPU decode step of a small batch is bound by its op count: the budget is what this two-layer
# model's step takes now, with a little room, so a change that adds ops per layer fails here.
OPS_BUDGET = 225


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.tensors = 0  # returned by those ops (an `unbind` returns one per row)

    def __torch_dispatch__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        result = func(*args, **(kwargs or {}))
        self.tensors += len(result) if isinstance(result, (tuple, list)) else 1
        return result


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("ops") / "model", SyntheticModel(num_layers=LAYERS))


def context(model: CausalLM, kv: PagedKVCache, tokens: int, position: int, slot: int) -> ForwardContext:
    """One sequence's forward context as a rank builds it (worker.RankWorker._context)."""
    slots = list(range(position, position + tokens))
    cos, sin = model.rope_tables(slots)
    lora = LoraBatch.from_token_slots(torch.full((tokens,), slot, dtype=torch.int64))
    blocks = list(range(-(-(position + tokens) // BLOCK)))
    attention = AttentionBatch(kv, torch.tensor(slots), block_table_tensor([blocks], torch.device("cpu")), [tokens], [position + tokens])
    return ForwardContext([tokens], 0, 0, lora, lora, cos, sin, attention, torch.tensor([tokens - 1]))


def build(model_dir: Path, dtype: torch.dtype = torch.float32) -> tuple[CausalLM, PagedKVCache]:
    """The tiny model at tp 1 in `dtype`, every module targeted by adapters in slots 1 and 2, and a KV cache."""
    cfg = ModelConfig.from_dir(model_dir)
    topology, cpu = Topology(1, 1), torch.device("cpu")
    groups = ProcessGroups(dict.fromkeys(ShardGroup))
    model = CausalLM(RankSetup(cfg, topology, 0, groups, LoraCapacity(16, 4, False), dtype, cpu))
    model.load_base(Checkpoint(model_dir))
    gen = torch.Generator().manual_seed(0)
    for module in model.lora_modules().values():
        for slot in (1, 2):
            module.set_slot(
                slot, [SliceWeights(torch.randn(a, generator=gen), torch.randn(b, generator=gen), 0.5) for a, b in module.slot_shapes()]
            )
    return model, PagedKVCache.from_budget(kv_cache_layout(cfg, topology, 0, BLOCK, dtype), 1 << 20, cpu)


def decode_step_ops(model: CausalLM, kv: PagedKVCache) -> OpCounter:
    """The ops of one decode step of one sequence with an adapter, after its prefill."""
    prompt = torch.arange(1, 7)
    model(prompt, context(model, kv, len(prompt), 0, 1))
    counter = OpCounter()
    with counter:
        logits = model(torch.tensor([7]), context(model, kv, 1, len(prompt), 1))
        sample(logits, [SequenceSampling(SamplingParams(), seed=0, index=0)])
    return counter


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_16_bit_decode_step_takes_the_fp32_steps_ops_and_a_cast_per_layer(model_dir: Path, dtype: torch.dtype) -> None:
    """A 16-bit step on the CPU widens each layer's input and narrows its output (two casts a
    module), and otherwise runs the fp32 step's kernels: no LoRA product or weight copy of its
    own (it once widened each slot's A and B in torch, about 1,100 ops a step of 8 sequences)."""
    wide = sum(decode_step_ops(*build(model_dir)).ops.values())
    counter = decode_step_ops(*build(model_dir, dtype))
    casts = 2 * (4 * LAYERS + 1) + 2 * (2 * LAYERS + 1) + 4 * LAYERS  # modules and LM head; norms; attention's q, k, v, out
    weight_products = 2 * LAYERS + 1  # a 16-bit norm multiplies by its weight after the cast
    assert sum(counter.ops.values()) <= wide + casts + weight_products + 4, counter.ops.most_common(12)
    assert counter.ops["aten.mm.default"] == counter.ops["aten.mv.default"] == counter.ops["aten.addmv_.default"] == 0


def test_one_decode_step_stays_within_its_op_budget(model_dir: Path) -> None:
    model, kv = build(model_dir)
    for module in model.lora_modules().values():  # on the CPU each slot's B is column-major (docs/kernels.md)
        for stack in getattr(module, "b_stacks", []):
            assert stack[1].stride() == (1, stack.shape[1]), "B of a slot should be held transposed"
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


def prefill_context(model: CausalLM, kv: PagedKVCache, length: int, slots: tuple[int, ...]) -> ForwardContext:
    """Whole prompts of `length` tokens, one per adapter slot of `slots`, in one step: each
    sequence on its own consecutive blocks, the last row of each sampling."""
    count, per_seq = len(slots), -(-length // BLOCK)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(count)]
    cos, sin = model.rope_tables([p for _ in slots for p in range(length)])
    lora = LoraBatch.from_token_slots(torch.tensor([s for s in slots for _ in range(length)]))
    kv_slots = torch.tensor([table[0] * BLOCK + p for table in tables for p in range(length)])
    attention = AttentionBatch(kv, kv_slots, block_table_tensor(tables, torch.device("cpu")), [length] * count, [length] * count)
    return ForwardContext(
        [length * count], 0, 0, lora, lora, cos, sin, attention, torch.tensor([(i + 1) * length - 1 for i in range(count)])
    )


def test_a_prefill_dispatches_as_many_ops_for_long_prompts_as_for_short(model_dir: Path) -> None:
    """Nothing in a prefill step runs per row or per prompt: prompts of equal length share each
    attention call, and the LoRA pass takes each adapter's rows as one slice. (It once unbound
    every row of every module's input and output, one op making 8,000 views for 8 prompts of
    32, and ran attention prompt by prompt.) Counted: ops, and the tensors they return."""
    model, kv = build(model_dir)

    def ops(length: int, slots: tuple[int, ...]) -> tuple[int, int]:
        counter = OpCounter()
        with counter:
            model(torch.arange(1, len(slots) * length + 1) % 200, prefill_context(model, kv, length, slots))
        return sum(counter.ops.values()), counter.tensors

    assert ops(24, (1, 1, 2, 2)) == ops(6, (1, 2))
