"""MoE (Qwen3-MoE) with expert parallelism and expert LoRA, against transformers + PEFT.

Expert LoRA comes in both forms PEFT produces: `target_parameters` LoRA on the fused 3-D expert
weights (current transformers) and per-expert modules (older transformers; PEFT converts them on
load, so PEFT is the reference for both).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from node_agent.engine import Engine, EngineConfig, SequenceInput, Topology
from node_agent.engine.adapters.errors import WEIGHTS_FILE
from node_agent.engine.adapters.spec import read_adapter_spec
from node_agent.engine.kernels import LoraBatch
from node_agent.engine.model.lora_layers import LoraCapacity
from node_agent.engine.model.moe import ExpertLoraLinear, ExpertSlotView, Routing, SparseMoeBlock
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.parallel.sharding import EXPERT_KINDS, local_experts, module_layout, unsharded_layout
from tests import support as R
from tests.engine.helpers import read_shard

MAX_RANK = 8
FUSED_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

# (tp, ep, dp, fully_sharded): tp in {2, 4}, ep in {1, 2, 4} dividing tp, dp in {1, 2}, both modes.
MATRIX = [(2, 1, 1, False), (2, 2, 2, True), (4, 1, 2, True), (4, 2, 1, False), (4, 4, 2, False), (4, 4, 1, True), (4, 2, 2, True)]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    model = R.make_tiny_model(root / "model", "qwen3_moe", seed=5)
    adapters = {
        # experts (fused form) and attention together
        "fused": R.make_adapter(
            model,
            root / "fused",
            seed=1,
            r=4,
            lora_alpha=8,
            a_std=0.3,
            b_std=0.3,
            target_modules=["q_proj", "v_proj"],
            target_parameters=FUSED_PARAMS,
        ),
        # experts only, rsLoRA, rank 2 < max rank
        "fused_rslora": R.make_adapter(
            model,
            root / "fused_rslora",
            seed=2,
            r=2,
            lora_alpha=4,
            use_rslora=True,
            a_std=0.3,
            b_std=0.3,
            target_modules=[],
            target_parameters=FUSED_PARAMS,
        ),
        "per_expert": R.make_per_expert_adapter(model, root / "per_expert", seed=3, r=4, lora_alpha=8),
    }
    tokens = [[(11 * i + 7 * j) % 250 for j in range(5 + 2 * i)] for i in range(4)]
    batch = [
        SequenceInput(tokens[0], "fused"),
        SequenceInput(tokens[1], None),
        SequenceInput(tokens[2], "per_expert"),
        SequenceInput(tokens[3], "fused_rslora"),
    ]
    reference = R.reference_logits(model, batch, adapters)
    base = R.reference_logits(model, [SequenceInput(s.tokens, None) for s in batch])
    return model, adapters, batch, reference, base


def test_every_adapter_changes_the_reference(moe):
    """Guards the comparison below: each adapter moves logits far beyond the tolerance."""
    _, _, batch, reference, base = moe
    for seq, ref, plain in zip(batch, reference, base, strict=True):
        if seq.adapter:
            assert (ref - plain).abs().max() > 1e-2, seq.adapter


@pytest.mark.parametrize("tp,ep,dp,fully_sharded", MATRIX, ids=[f"tp{t}-ep{e}-dp{d}-{'fs' if f else 'default'}" for t, e, d, f in MATRIX])
def test_moe_logits_equal_peft(moe, tp, ep, dp, fully_sharded):
    model, adapters, batch, reference, _ = moe
    config = EngineConfig(
        model_dir=model,
        topology=Topology(tp, dp, ep_size=ep, fully_sharded_loras=fully_sharded),
        max_lora_rank=MAX_RANK,
        max_loras_per_batch=3,
    )
    with Engine(config) as engine:
        for name, path in adapters.items():
            engine.load_adapter(name, path)
        logits = engine.forward(batch)
        # One sequence only: with dp=2 the other attention group is idle.
        alone = engine.forward([batch[2]])
    for seq, got, want in zip(batch, logits, reference, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m, name=seq.adapter: f"{name}: {m}")
    torch.testing.assert_close(alone[0], reference[2], atol=1e-4, rtol=1e-4)


SHARED_MATRIX = [(2, 2, 2, True), (4, 2, 1, False), (4, 4, 2, True)]


@pytest.fixture(scope="module")
def shared_expert_moe(tmp_path_factory):
    """Qwen2-MoE: a shared expert (full-TP MLP) and its replicated [1, hidden] gate beside the experts."""
    root = tmp_path_factory.mktemp("qwen2_moe")
    model = R.make_tiny_model(root / "model", "qwen2_moe", seed=6)
    adapters = {
        # all-linear: attention, shared expert and its gate; plus the fused routed experts
        "everything": R.make_adapter(
            model,
            root / "everything",
            seed=4,
            r=4,
            lora_alpha=8,
            a_std=0.3,
            b_std=0.3,
            target_modules="all-linear",
            target_parameters=FUSED_PARAMS,
        ),
        "shared_only": R.make_adapter(
            model,
            root / "shared_only",
            seed=5,
            r=2,
            lora_alpha=8,
            a_std=0.3,
            b_std=0.3,
            target_modules=["shared_expert_gate", "gate_proj", "down_proj"],
        ),
    }
    tokens = [[(13 * i + 5 * j) % 250 for j in range(4 + 3 * i)] for i in range(3)]
    batch = [SequenceInput(tokens[0], "everything"), SequenceInput(tokens[1], None), SequenceInput(tokens[2], "shared_only")]
    reference = R.reference_logits(model, batch, adapters)
    base = R.reference_logits(model, [SequenceInput(s.tokens, None) for s in batch])
    for seq, ref, plain in zip(batch, reference, base, strict=True):
        if seq.adapter:
            assert (ref - plain).abs().max() > 1e-2, seq.adapter
    return model, adapters, batch, reference


@pytest.mark.parametrize(
    "tp,ep,dp,fully_sharded", SHARED_MATRIX, ids=[f"tp{t}-ep{e}-dp{d}-{'fs' if f else 'default'}" for t, e, d, f in SHARED_MATRIX]
)
def test_shared_expert_logits_equal_peft(shared_expert_moe, tp, ep, dp, fully_sharded):
    model, adapters, batch, reference = shared_expert_moe
    config = EngineConfig(
        model_dir=model,
        topology=Topology(tp, dp, ep_size=ep, fully_sharded_loras=fully_sharded),
        max_lora_rank=MAX_RANK,
        max_loras_per_batch=2,
    )
    with Engine(config) as engine:
        for name, path in adapters.items():
            engine.load_adapter(name, path)
        logits = engine.forward(batch)
    for seq, got, want in zip(batch, logits, reference, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m, name=seq.adapter: f"{name}: {m}")


@pytest.mark.parametrize("fully_sharded", [False, True])
@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4)])
def test_expert_buffers_match_slices_and_rebuild_each_expert(moe, tp, ep, fully_sharded):
    """Invariant 3 for expert modules, in both adapter forms; slices of all ranks rebuild every expert."""
    model, adapters, *_ = moe
    cfg = ModelConfig.from_dir(model)
    topology = Topology(tp, 1, ep_size=ep, fully_sharded_loras=fully_sharded)
    capacity = LoraCapacity(MAX_RANK, 2, fully_sharded)
    per_expert = load_file(str(adapters["per_expert"] / WEIGHTS_FILE))
    rebuilt: dict[tuple, torch.Tensor] = {}
    for rank in range(tp):
        experts = local_experts(cfg, topology, rank)
        assert experts.width == cfg.moe.num_experts // ep
        views = {}
        for kind in EXPERT_KINDS:
            module = ExpertLoraLinear(module_layout(cfg, topology, rank, kind), experts, None, capacity, torch.float32, torch.device("cpu"))
            for local, expert in enumerate(range(experts.start, experts.stop)):
                views[(0, kind, expert)] = ExpertSlotView(module, local)
        layouts = {key: view.lora_slices() for key, view in views.items()}
        for name in ("fused", "per_expert"):
            spec = read_adapter_spec(adapters[name], cfg, MAX_RANK)
            experts_only = dataclasses.replace(spec, modules=tuple(m for m in spec.modules if m.expert is not None))
            shard = read_shard(experts_only, layouts)
            assert set(shard.weights) == set(views), "exactly the local experts are read"
            for key, parts in shard.weights.items():
                for index, (part, (a_shape, b_shape)) in enumerate(zip(parts, views[key].slot_shapes(), strict=True)):
                    assert list(part.a.shape) == a_shape and list(part.b.shape) == b_shape, (rank, key, index)
                    if name == "per_expert":
                        _place(rebuilt, cfg, key, index, views[key].lora_slices()[index], part)
    assert len(rebuilt) == 2 * 3 * cfg.moe.num_experts, "every expert's gate, up and down, A and B"
    for (expert, projection, which), tensor in rebuilt.items():
        want = per_expert[f"base_model.model.model.layers.0.mlp.experts.{expert}.{projection}.lora_{which}.weight"]
        got = tensor[:4] if which == "A" else tensor[:, :4]  # the adapter's rank is 4
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert not (tensor[4:] if which == "A" else tensor[:, 4:]).any(), "rank padding is zero"


def _place(rebuilt, cfg, key, index, layout, part):
    """Put one rank's slice of an expert's A and B at its layout position in the full tensors."""
    _, kind, expert = key
    full = unsharded_layout(cfg, kind).slices[index]
    projection, out_features, in_features = full.peft_module, full.out.width, full.inp.width
    a = rebuilt.setdefault((expert, projection, "A"), torch.zeros(MAX_RANK, in_features))
    b = rebuilt.setdefault((expert, projection, "B"), torch.zeros(out_features, MAX_RANK))
    a[layout.a_rank.start : layout.a_rank.stop, layout.a_in.start : layout.a_in.stop] = part.a
    b[layout.b_out.start : layout.b_out.stop, layout.b_rank.start : layout.b_rank.stop] = part.b


def test_tokens_of_other_experts_and_id_minus_one_contribute_nothing(moe):
    """A token routed to an expert held elsewhere, or to −1, gets no output here (and no LoRA)."""
    model, *_ = moe
    cfg = ModelConfig.from_dir(model)
    topology = Topology(2, 1, ep_size=2)
    rank = 0  # holds experts 0 and 1 of 4
    capacity = LoraCapacity(MAX_RANK, 1, False)
    experts = local_experts(cfg, topology, rank)
    projections = [
        ExpertLoraLinear(module_layout(cfg, topology, rank, kind), experts, None, capacity, torch.float32, torch.device("cpu"))
        for kind in EXPERT_KINDS
    ]
    for module in projections:
        module.weight.normal_()
        for stack in (*module.a_stacks, *module.b_stacks):
            stack.normal_()
        module.scales.fill_(1.0)
    block = SparseMoeBlock(Routing(cfg.moe.num_experts, 2, True), cfg.hidden_size, *projections, torch.float32, torch.device("cpu"))
    x = torch.randn(4, cfg.hidden_size)
    ids = torch.tensor([[0, 1], [2, 3], [-1, -1], [1, -1]])
    weights = torch.full((4, 2), 0.5)
    out = block.experts_forward(x, ids, weights, LoraBatch.from_token_slots(torch.tensor([0, 0, 0, -1])))
    assert out[0].abs().sum() > 0 and out[3].abs().sum() > 0
    assert torch.equal(out[1], torch.zeros_like(out[1])), "experts 2 and 3 live on the other rank"
    assert torch.equal(out[2], torch.zeros_like(out[2])), "id -1 selects no expert"


def test_forward_command_with_expert_parallelism_matches_peft(moe, tmp_path):
    """`lorafleet-agent forward --ep` runs the MoE engine end to end."""
    model, adapters, batch, reference, _ = moe
    inp = tmp_path / "in.json"
    inp.write_text(json.dumps([{"tokens": s.tokens, "adapter": s.adapter} for s in batch]))
    out = tmp_path / "out.safetensors"
    cmd = [
        str(Path(sys.executable).with_name("lorafleet-agent")),
        "forward",
        "--model",
        str(model),
        "--tp",
        "2",
        "--dp",
        "2",
        "--ep",
        "2",
        "--max-lora-rank",
        str(MAX_RANK),
        "--max-loras-per-batch",
        "3",
        "--input",
        str(inp),
        "--output",
        str(out),
    ]
    for name, path in adapters.items():
        cmd += ["--adapter", f"{name}={path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    logits = load_file(str(out))
    for index, want in enumerate(reference):
        torch.testing.assert_close(logits[f"logits.{index}"], want, atol=1e-4, rtol=1e-4)
