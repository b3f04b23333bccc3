"""Invariant 3: allocated LoRA buffer widths equal the widths slicing produces (no PEFT needed).

For every module, rank, topology and LoRA mode, the adapter loader's slices of a real adapter
file must have exactly the shape of the layer's buffers, and the slices of all ranks must put
the unsharded (rank-padded) adapter back together.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from lorafleet_dev.synthetic import SyntheticModel, write_adapter, write_model
from node_agent.engine.adapters.errors import WEIGHTS_FILE
from node_agent.engine.adapters.spec import read_adapter_spec
from node_agent.engine.model.lora_layers import LAYER_CLASSES, LoraCapacity
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.parallel.sharding import DENSE_KINDS, MODULE_KINDS, ParallelStyle, module_layout
from node_agent.engine.parallel.topology import Topology
from tests.engine.helpers import read_shard

MAX_RANK = 8
ADAPTER_RANK = 3  # below max rank and not divisible by tp: exercises padding

SHAPES = {
    "kv2": SyntheticModel(num_heads=8, num_kv_heads=2, head_dim=8, hidden_size=32, intermediate_size=64),
    "kv1_headdim": SyntheticModel(num_heads=8, num_kv_heads=1, head_dim=12, hidden_size=32, intermediate_size=64, model_type="qwen3"),
}
TOPOLOGIES = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2)]


@pytest.fixture(scope="module", params=sorted(SHAPES))
def model_and_adapter(request, tmp_path_factory):
    shape = SHAPES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    model_dir = write_model(root / "model", shape)
    adapter_dir = write_adapter(root / "adapter", shape, rank=ADAPTER_RANK)
    return shape, ModelConfig.from_dir(model_dir), adapter_dir


def build_layers(cfg: ModelConfig, topology: Topology, rank: int):
    capacity = LoraCapacity(MAX_RANK, slots=2, fully_sharded=topology.fully_sharded_loras)
    return {
        (0, name): LAYER_CLASSES[kind.style](
            module_layout(cfg, topology, rank, name), None, capacity, False, torch.float32, torch.device("cpu")
        )
        for name, kind in ((n, MODULE_KINDS[n]) for n in DENSE_KINDS)
    }


@pytest.mark.parametrize("fully_sharded", [False, True], ids=["default", "fully_sharded"])
@pytest.mark.parametrize("tp,dp", TOPOLOGIES, ids=[f"tp{t}dp{d}" for t, d in TOPOLOGIES])
def test_buffers_match_slices_and_slices_rebuild_the_adapter(model_and_adapter, tp, dp, fully_sharded):
    shape, cfg, adapter_dir = model_and_adapter
    topology = Topology(tp, dp, fully_sharded_loras=fully_sharded)
    spec = read_adapter_spec(adapter_dir, cfg, MAX_RANK)
    full = load_file(str(adapter_dir / WEIGHTS_FILE))
    pieces: dict[str, list] = {}
    for rank in range(tp):
        layers = build_layers(cfg, topology, rank)
        layouts = {key: layer.lora_slices() for key, layer in layers.items()}
        shard = read_shard(spec, layouts | _other_layers(layouts, shape))
        for (layer_index, kind), weights in shard.weights.items():
            if layer_index != 0:
                continue
            layer = layers[(0, kind)]
            for index, part in enumerate(weights):
                assert part is not None
                assert tuple(part.a.shape) == tuple(layer.a_stacks[index].shape[1:]), (rank, kind, index)
                assert tuple(part.b.shape) == tuple(layer.b_stacks[index].shape[1:]), (rank, kind, index)
                pieces.setdefault(layer.lora[index].peft_module, []).append((rank, layer, index, part))
    for peft_module, parts in pieces.items():
        _assert_rebuilds(peft_module, parts, full, topology)


def _other_layers(layouts, shape):
    # The synthetic adapter targets every layer; layouts are identical across layers.
    return {(layer, kind): value for (_, kind), value in layouts.items() for layer in range(1, shape.num_layers)}


def _assert_rebuilds(peft_module, parts, full, topology):
    """Placing every rank's slice at its layout position gives back the padded PEFT tensors."""
    parent = "self_attn" if peft_module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    key = f"base_model.model.model.layers.0.{parent}.{peft_module}"
    a_full, b_full = full[f"{key}.lora_A.weight"], full[f"{key}.lora_B.weight"]
    a_rebuilt = torch.zeros(MAX_RANK, a_full.shape[1])
    b_rebuilt = torch.zeros(b_full.shape[0], MAX_RANK)
    for _, layer, index, part in parts:
        lay = layer.lora[index]
        a_rebuilt[lay.a_rank.start : lay.a_rank.stop, lay.a_in.start : lay.a_in.stop] = part.a
        b_rebuilt[lay.b_out.start : lay.b_out.stop, lay.b_rank.start : lay.b_rank.stop] = part.b
    torch.testing.assert_close(a_rebuilt[:ADAPTER_RANK], a_full, rtol=0, atol=0)
    torch.testing.assert_close(b_rebuilt[:, :ADAPTER_RANK], b_full, rtol=0, atol=0)
    assert not a_rebuilt[ADAPTER_RANK:].any() and not b_rebuilt[:, ADAPTER_RANK:].any(), "rank padding must be zero"


@pytest.mark.parametrize("tp,dp", [(2, 1), (4, 1), (4, 2), (8, 1)])
def test_qkv_width_with_kv_head_replication(model_and_adapter, tp, dp):
    """Per-rank qkv B width is q/attn_tp + 2·head_dim when KV heads are fewer than attn_tp."""
    _, cfg, _ = model_and_adapter
    topology = Topology(tp, dp)
    for rank in range(tp):
        layer = build_layers(cfg, topology, rank)[(0, "qkv_proj")]
        attn_tp = topology.attn_tp_size
        kv_local = 1 if attn_tp > cfg.num_kv_heads else cfg.num_kv_heads // attn_tp
        expected = cfg.q_size // attn_tp + 2 * kv_local * cfg.head_dim
        assert sum(b.shape[1] for b in layer.b_stacks) == expected == layer.weight.shape[0]
        if attn_tp > cfg.num_kv_heads:
            replicas = attn_tp // cfg.num_kv_heads
            k_slice = layer.lora[1].b_out
            assert k_slice.start == (topology.coords(rank).attn_tp_rank // replicas) * cfg.head_dim


@pytest.mark.parametrize("fully_sharded", [False, True])
@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 1), (4, 2), (4, 4)])
def test_shrink_gather_only_in_fully_sharded_mode_with_tp(model_and_adapter, tp, dp, fully_sharded):
    """The shrink all-gather/all-reduce exists only in fully-sharded mode on a group wider than 1."""
    _, cfg, _ = model_and_adapter
    topology = Topology(tp, dp, fully_sharded_loras=fully_sharded)
    for rank in range(tp):
        for key, layer in build_layers(cfg, topology, rank).items():
            assert layer.gathers_shrink == (fully_sharded and layer.layout.shard.size > 1), key
            if layer.style is ParallelStyle.COLUMN and not layer.gathers_shrink:
                assert all(a.shape[1] == MAX_RANK for a in layer.a_stacks), "default mode keeps A whole"


def test_attention_modules_use_the_attention_group(model_and_adapter):
    """Attention modules are sliced by the attention-TP rank, MLP modules by the global rank."""
    _, cfg, _ = model_and_adapter
    topology = Topology(4, 2)
    for rank in range(4):
        layers = build_layers(cfg, topology, rank)
        assert layers[(0, "qkv_proj")].layout.shard.rank == topology.coords(rank).attn_tp_rank
        assert layers[(0, "o_proj")].layout.shard.size == 2
        assert layers[(0, "gate_up_proj")].layout.shard.rank == rank
        assert layers[(0, "down_proj")].layout.shard.size == 4
