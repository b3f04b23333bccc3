"""DeepSeek-V2/V3 (MLA + MoE) against transformers + PEFT.

Tiny random models made with transformers: V2 without q_lora_rank (q_proj), YaRN, softmax
routing (greedy, and group-limited in a second model); V3 with q_a_proj → q_a_layernorm →
q_b_proj, sigmoid group-limited routing with a drawn e_score_correction_bias and
routed_scaling_factor. Layer 0 is dense (first_k_dense_replace), layer 1 routed + shared experts.
One engine per topology serves both the logits test and the greedy generate test:

* V2 at tp=2 dp=2 ep=1 (attention-TP 1), default LoRA mode;
* V3 at tp=4 dp=2 ep=2 (attention-TP 2, MoE-TP 2), fully-sharded LoRA mode;
* V3 at tp=2 dp=1 ep=2 (attention-TP 2, one expert group per rank), default mode;
* V2 group-limited at tp=4 dp=4 ep=4 (attention-TP 1, one expert per rank), default mode.

Adapters: every MLA projection, the dense MLP, the shared experts and the routed experts in the
fused form together; the per-expert form with kv_b_proj; base-only sequences in the same batch;
one sequence alone, so the other DP groups are idle.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from node_agent.engine import Engine, EngineConfig, SamplingParams, SequenceInput, Topology
from node_agent.engine.adapters.errors import WEIGHTS_FILE, AdapterLoadError
from node_agent.engine.adapters.spec import read_adapter_spec
from node_agent.engine.model.lora_layers import LAYER_CLASSES, LoraCapacity
from node_agent.engine.model_config import ModelConfig, ModelConfigError
from node_agent.engine.parallel.sharding import (
    MLP_KINDS,
    MODULE_KINDS,
    ParallelStyle,
    local_experts,
    lora_layout,
    model_kinds,
    module_layout,
    unsharded_layout,
)
from node_agent.engine.serving.kv_cache import KVCacheError, KVCacheLayout, PagedKVCache, kv_cache_layout
from tests import support as R
from tests.engine.helpers import draw_tokens, read_shard
from tests.support.deepseek import FUSED_EXPERTS, MLP_MODULES, make_per_expert_adapter, mla_modules
from tests.support.models import load_base_model, model_config, quietly

MAX_RANK = 8
BLOCK_SIZE = 4
# name -> (family, make_tiny_model overrides)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "v2": ("deepseek_v2", {}),
    "v3": ("deepseek_v3", {}),
    "v2_grouped": ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=2, topk_group=1)),
}


@dataclass(frozen=True)
class Topo:
    model: str
    tp: int
    dp: int
    ep: int
    fully_sharded: bool

    @property
    def id(self) -> str:
        return f"{self.model}-tp{self.tp}-dp{self.dp}-ep{self.ep}-{'fs' if self.fully_sharded else 'default'}"


TOPOLOGIES = [Topo("v2", 2, 2, 1, False), Topo("v3", 4, 2, 2, True), Topo("v3", 2, 1, 2, False), Topo("v2_grouped", 4, 4, 4, False)]


@dataclass
class Built:
    model: Path
    adapters: dict[str, Path]
    batch: list[SequenceInput]
    reference: list[torch.Tensor]
    base: list[torch.Tensor]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Built]:
    """Each model, its adapters, a mixed batch and the oracle's logits for it."""
    out = {}
    for name, (family, overrides) in MODELS.items():
        root = tmp_path_factory.mktemp(f"deepseek-{name}")
        model = R.make_tiny_model(root / "model", family, seed=7, **overrides)
        adapters = {
            "everything": R.make_adapter(
                model,
                root / "everything",
                seed=1,
                r=4,
                lora_alpha=8,
                a_std=0.3,
                b_std=0.3,
                target_modules=[*mla_modules(model), *MLP_MODULES],
                target_parameters=FUSED_EXPERTS,
            ),
            "per_expert": make_per_expert_adapter(model, root / "per_expert", seed=2, r=4, lora_alpha=8),
            # MLA only, rsLoRA, rank 2 < max rank
            "mla_rslora": R.make_adapter(
                model,
                root / "mla_rslora",
                seed=3,
                r=2,
                lora_alpha=4,
                use_rslora=True,
                a_std=0.3,
                b_std=0.3,
                target_modules=mla_modules(model),
            ),
        }
        vocab = model_config(model)["vocab_size"]
        names: list[str | None] = ["everything", None, "per_expert", "mla_rslora", None]
        batch = [SequenceInput(draw_tokens(40 + i, 3 + 2 * i, vocab), adapter) for i, adapter in enumerate(names)]
        reference = R.reference_logits(model, batch, adapters)
        base = R.reference_logits(model, [SequenceInput(s.tokens, None) for s in batch])
        out[name] = Built(model, adapters, batch, reference, base)
    return out


def test_every_adapter_changes_the_reference(built):
    """Guards the comparisons below: each adapter moves logits far beyond the tolerance."""
    for name, item in built.items():
        for seq, ref, plain in zip(item.batch, item.reference, item.base, strict=True):
            if seq.adapter:
                assert (ref - plain).abs().max() > 1e-2, (name, seq.adapter)


@dataclass
class Served:
    topo: Topo
    engine: Engine
    item: Built


@pytest.fixture(scope="module", params=TOPOLOGIES, ids=[t.id for t in TOPOLOGIES])
def served(request, built) -> Iterator[Served]:
    topo: Topo = request.param
    item = built[topo.model]
    config = EngineConfig(
        model_dir=item.model,
        topology=Topology(topo.tp, topo.dp, ep_size=topo.ep, fully_sharded_loras=topo.fully_sharded),
        max_lora_rank=MAX_RANK,
        max_loras_per_batch=3,
        block_size=BLOCK_SIZE,
        max_num_seqs=8,
        max_num_batched_tokens=16,
    )
    with Engine(config) as engine:
        for name, path in item.adapters.items():
            engine.load_adapter(name, path)
        yield Served(topo, engine, item)


def test_logits_equal_peft_with_base_sequences_and_an_idle_group(served: Served):
    item = served.item
    logits = served.engine.forward(item.batch)
    # One sequence only: every other attention group is idle for the whole forward.
    alone = served.engine.forward([item.batch[2]])
    for seq, got, want in zip(item.batch, logits, item.reference, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m, name=seq.adapter: f"{name}: {m}")
    torch.testing.assert_close(alone[0], item.reference[2], atol=1e-4, rtol=1e-4)


def test_describe_reports_every_module_per_rank_and_the_latent_blocks(served: Served):
    """Every rank reports each MLA, MLP and expert module with the shapes the one rule gives it,
    and blocks of latents (one per token), not of per-head K/V."""
    topo, cfg = served.topo, ModelConfig.from_dir(served.item.model)
    topology = Topology(topo.tp, topo.dp, ep_size=topo.ep, fully_sharded_loras=topo.fully_sharded)
    for reply in served.engine.describe():
        shapes = {module.module: [(list(s.lora_a), list(s.lora_b)) for s in module.slices] for module in reply.modules}
        first_expert = local_experts(cfg, topology, reply.rank).start
        for layer in range(cfg.num_layers):
            sparse = layer in cfg.experts().sparse_layers
            for kind in model_kinds(cfg):
                if kind.startswith("experts."):
                    name, present = f"layers.{layer}.experts.{first_expert}.{kind.split('.')[1]}", sparse
                else:
                    name = f"layers.{layer}.{kind}"
                    present = sparse if kind.startswith("shared_") else not sparse if kind in MLP_KINDS else True
                assert (name in shapes) == present, (reply.rank, name)
                if present:
                    lora = lora_layout(module_layout(cfg, topology, reply.rank, kind), MAX_RANK, topo.fully_sharded)
                    want = [([s.a_rank.width, s.a_in.width], [s.b_out.width, s.b_rank.width]) for s in lora]
                    assert shapes[name] == want, (reply.rank, name)
        layout = kv_cache_layout(cfg, topology, reply.rank, BLOCK_SIZE, torch.float32)
        assert layout.latent and reply.kv_block_bytes == layout.bytes_per_block


_HF: dict[tuple[str, str | None], Any] = {}


@quietly
@torch.no_grad()
def reference_generate(model_dir: Path, adapter_dir: Path | None, tokens: list[int], max_tokens: int) -> list[int]:
    """Greedy transformers (+ peft) `generate`, its own cache, fp32, exactly `max_tokens` tokens."""
    from peft import PeftModel

    key = (str(model_dir), None if adapter_dir is None else str(adapter_dir))
    if key not in _HF:
        base = load_base_model(model_dir)
        _HF[key] = base if adapter_dir is None else PeftModel.from_pretrained(copy.deepcopy(base), str(adapter_dir)).eval()
    out = _HF[key].generate(
        input_ids=torch.tensor([tokens]),
        attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return list(out[0, len(tokens) :].tolist())


def test_concurrent_greedy_generate_equals_peft(served: Served):
    """Eight requests at once (chunked prefill over a 16-token budget, 4-token blocks): the paged
    latent cache gives transformers' tokens, adapters and base alike."""
    item = served.item
    vocab = model_config(item.model)["vocab_size"]
    names: list[str | None] = ["everything", None, "per_expert", "mla_rslora"]
    reqs = [(draw_tokens(300 + i, 2 + (5 * i) % 11, vocab), names[i % 4], 3 + (3 * i) % 7) for i in range(8)]
    handles = [served.engine.submit(tokens, adapter, SamplingParams(max_tokens=n)) for tokens, adapter, n in reqs]
    got = [[step.token_id for step in handle.tokens()] for handle in handles]
    want = [reference_generate(item.model, None if a is None else item.adapters[a], t, n) for t, a, n in reqs]
    assert got == want
    stats = served.engine.serving_stats()
    assert stats.free_blocks == (stats.num_blocks,) * len(stats.free_blocks), "every latent block is free again"


MLA_KINDS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
LAYOUT_TOPOLOGIES = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]


@pytest.mark.parametrize("fully_sharded", [False, True], ids=["default", "fs"])
@pytest.mark.parametrize("tp,dp", LAYOUT_TOPOLOGIES, ids=[f"tp{t}dp{d}" for t, d in LAYOUT_TOPOLOGIES])
def test_mla_buffers_match_slices_and_rebuild_the_adapter(built, tp, dp, fully_sharded):
    """Invariant 3 for every MLA module: the loader's slices have the buffers' shapes on every rank;
    replicated modules hold the whole A and B on each rank (both modes); the column and row
    modules' slices of all ranks put the adapter back together."""
    topology = Topology(tp, dp, fully_sharded_loras=fully_sharded)
    capacity = LoraCapacity(MAX_RANK, slots=2, fully_sharded=fully_sharded)
    for name in ("v2", "v3"):
        item = built[name]
        cfg = ModelConfig.from_dir(item.model)
        kinds = [k for k in model_kinds(cfg) if k in MLA_KINDS]
        assert len(kinds) == (4 if name == "v2" else 5)
        spec = read_adapter_spec(item.adapters["everything"], cfg, MAX_RANK)
        spec = dataclasses.replace(spec, modules=tuple(m for m in spec.modules if m.layer == 0 and m.kind in kinds))
        full = load_file(str(item.adapters["everything"] / WEIGHTS_FILE))
        rebuilt: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for rank in range(tp):
            layers = {
                (0, kind): LAYER_CLASSES[MODULE_KINDS[kind].style](
                    module_layout(cfg, topology, rank, kind), None, capacity, False, torch.float32, torch.device("cpu")
                )
                for kind in kinds
            }
            shard = read_shard(spec, {key: layer.lora_slices() for key, layer in layers.items()})
            assert set(shard.weights) == set(layers)
            for key, (part,) in shard.weights.items():
                layer, kind = layers[key], key[1]
                assert part is not None
                assert tuple(part.a.shape) == tuple(layer.a_stacks[0].shape[1:]), (name, rank, kind)
                assert tuple(part.b.shape) == tuple(layer.b_stacks[0].shape[1:]), (name, rank, kind)
                peft = f"base_model.model.model.layers.0.self_attn.{kind}"
                a_full, b_full = full[f"{peft}.lora_A.weight"], full[f"{peft}.lora_B.weight"]
                if MODULE_KINDS[kind].style is ParallelStyle.REPLICATED:
                    assert layer.layout.shard.size == 1
                    torch.testing.assert_close(part.a[:4], a_full, rtol=0, atol=0)
                    torch.testing.assert_close(part.b[:, :4], b_full, rtol=0, atol=0)
                lay = layer.lora[0]
                a, b = rebuilt.setdefault(kind, (torch.zeros(MAX_RANK, a_full.shape[1]), torch.zeros(b_full.shape[0], MAX_RANK)))
                a[lay.a_rank.start : lay.a_rank.stop, lay.a_in.start : lay.a_in.stop] = part.a
                b[lay.b_out.start : lay.b_out.stop, lay.b_rank.start : lay.b_rank.stop] = part.b
        assert sorted(rebuilt) == sorted(kinds)
        for kind, (a, b) in rebuilt.items():
            peft = f"base_model.model.model.layers.0.self_attn.{kind}"
            torch.testing.assert_close(a[:4], full[f"{peft}.lora_A.weight"], rtol=0, atol=0)
            torch.testing.assert_close(b[:, :4], full[f"{peft}.lora_B.weight"], rtol=0, atol=0)
            assert not a[4:].any() and not b[:, 4:].any(), "rank padding is zero"


def test_mla_modules_use_their_groups_and_split_by_heads(built):
    """q/kv_b column-parallel and o_proj row-parallel by whole heads over the attention-TP group;
    q_a_proj and kv_a_proj_with_mqa whole; shared experts over the full TP group."""
    cfg = ModelConfig.from_dir(built["v3"].model)
    mla = cfg.latent()
    topology = Topology(4, 2, ep_size=2)
    for rank in range(4):
        attn_rank = topology.coords(rank).attn_tp_rank
        q_b = module_layout(cfg, topology, rank, "q_b_proj")
        assert q_b.shard.size == 2 and q_b.shard.rank == attn_rank
        assert q_b.slices[0].out.start == attn_rank * 2 * mla.qk_head_dim and q_b.base_shape == (2 * mla.qk_head_dim, 24)
        kv_b = module_layout(cfg, topology, rank, "kv_b_proj")
        assert kv_b.base_shape == (2 * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
        o = module_layout(cfg, topology, rank, "o_proj")
        assert o.slices[0].inp.start == attn_rank * 2 * mla.v_head_dim and o.base_shape == (cfg.hidden_size, 2 * mla.v_head_dim)
        for kind in ("q_a_proj", "kv_a_proj_with_mqa"):
            assert module_layout(cfg, topology, rank, kind).base_shape == unsharded_layout(cfg, kind).base_shape
        shared = module_layout(cfg, topology, rank, "shared_experts.down_proj")
        assert shared.shard.size == 4 and shared.shard.rank == rank


def test_the_kv_cache_holds_one_latent_per_token_on_every_rank(built):
    """MLA caches kv_lora_rank + qk_rope_head_dim per token and layer, whatever the rank's heads,
    and refuses K/V access; the per-head cache it replaces would hold heads · (qk + v) per token."""
    cfg = ModelConfig.from_dir(built["v2"].model)
    mla = cfg.latent()
    for tp, dp in ((1, 1), (4, 1), (4, 4)):
        for rank in range(tp):
            layout = kv_cache_layout(cfg, Topology(tp, dp), rank, BLOCK_SIZE, torch.float32)
            assert layout == KVCacheLayout(
                cfg.num_layers, 1, mla.kv_lora_rank + mla.qk_rope_head_dim, BLOCK_SIZE, torch.float32, latent=True
            )
    layout = kv_cache_layout(cfg, Topology(1), 0, BLOCK_SIZE, torch.float32)
    assert layout.bytes_per_token == cfg.num_layers * 20 * 4
    per_head = cfg.num_layers * cfg.num_heads * (mla.qk_head_dim + mla.v_head_dim) * 4
    assert layout.bytes_per_token * 4 < per_head
    cache = PagedKVCache(layout, 3, torch.device("cpu"))
    latent = torch.randn(2, 20)
    cache.write_latent(1, torch.tensor([5, 0]), latent)
    assert torch.equal(cache.latent(1).view(-1, 20)[[5, 0]], latent)
    assert not cache.latent(0).any(), "other layers untouched"
    with pytest.raises(KVCacheError, match="no V"):
        cache.value(0)
    with pytest.raises(KVCacheError, match="write_latent"):
        cache.write(0, torch.tensor([1]), torch.zeros(1, 1, 20), torch.zeros(1, 1, 20))


def test_refusals_stay_as_they_are(built, tmp_path):
    """A module the model lacks (q_a_proj on V2, q_proj on V3) or a tensor that does not fit is refused."""
    v2, v3 = ModelConfig.from_dir(built["v2"].model), ModelConfig.from_dir(built["v3"].model)
    with pytest.raises(AdapterLoadError, match="does not have module"):
        read_adapter_spec(built["v3"].adapters["mla_rslora"], v2, MAX_RANK)  # q_a_proj, q_b_proj
    with pytest.raises(AdapterLoadError, match="does not have module"):
        read_adapter_spec(built["v2"].adapters["mla_rslora"], v3, MAX_RANK)  # q_proj
    other = R.make_tiny_model(tmp_path / "wider", "deepseek_v2", seed=8, kv_lora_rank=12)
    with pytest.raises(AdapterLoadError, match="does not fit the base model"):
        read_adapter_spec(built["v2"].adapters["mla_rslora"], ModelConfig.from_dir(other), MAX_RANK)


def test_configs_transformers_would_compute_otherwise_are_refused(built):
    raw = model_config(built["v2"].model)
    with pytest.raises(ModelConfigError, match="num_key_value_heads"):
        ModelConfig.from_dict({**raw, "num_key_value_heads": 2})
    with pytest.raises(ModelConfigError, match="topk_method"):
        ModelConfig.from_dict({**raw, "topk_method": "noaux_tc"})
