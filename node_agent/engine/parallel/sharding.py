"""Which group shards each module, and which slice of each tensor a rank holds (docs/design.md §3).

This module is the single answer to "how is this module split on this rank": the group of every
split (`MODULE_KINDS`), the one function that turns a group into a rank's size and index
(`effective_shard`), and every per-rank size derived from them. Base-weight loading, LoRA buffer
allocation, LoRA weight slicing and the adapter loader's shape checks all read the layouts built
here, so a buffer width can never disagree with the width that slicing produces.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from node_agent.engine.model_config import ModelConfig
from node_agent.engine.parallel.topology import Topology, TopologyError


class ShardGroup(Enum):
    """The group a split is made over: for a linear module, the group its base layer is built with."""

    FULL_TP = "tp"
    ATTN_TP = "attn_tp"
    MOE_TP = "moe_tp"
    EP = "ep"  # the routed experts themselves, split over the expert-parallel groups
    REPLICATED = "replicated"


class ParallelStyle(Enum):
    """What a kind splits over its group."""

    COLUMN = "column"  # output features split; input whole
    ROW = "row"  # input features split; partial outputs reduced over the group
    REPLICATED = "replicated"
    VOCAB = "vocab"  # rows of the (padded) vocabulary; no LoRA
    EXPERTS = "experts"  # the routed experts of a layer; no LoRA of its own


@dataclass(frozen=True)
class ModuleKind:
    """One kind of split module of the engine, and the PEFT module names fused into it."""

    name: str
    group: ShardGroup
    style: ParallelStyle
    peft_modules: tuple[str, ...]  # one per output slice, in fused order; () for kinds without LoRA
    parent: str  # where PEFT's module path puts it: "self_attn", "mlp", "mlp.experts", ...


MODULE_KINDS: dict[str, ModuleKind] = {
    kind.name: kind
    for kind in (
        ModuleKind("qkv_proj", ShardGroup.ATTN_TP, ParallelStyle.COLUMN, ("q_proj", "k_proj", "v_proj"), "self_attn"),
        ModuleKind("o_proj", ShardGroup.ATTN_TP, ParallelStyle.ROW, ("o_proj",), "self_attn"),
        ModuleKind("gate_up_proj", ShardGroup.FULL_TP, ParallelStyle.COLUMN, ("gate_proj", "up_proj"), "mlp"),
        ModuleKind("down_proj", ShardGroup.FULL_TP, ParallelStyle.ROW, ("down_proj",), "mlp"),
        # Routed experts: each expert's intermediate dim is split over the MoE-TP group.
        ModuleKind("experts.gate_up_proj", ShardGroup.MOE_TP, ParallelStyle.COLUMN, ("gate_proj", "up_proj"), "mlp.experts"),
        ModuleKind("experts.down_proj", ShardGroup.MOE_TP, ParallelStyle.ROW, ("down_proj",), "mlp.experts"),
        # The shared expert is a dense MLP beside the routed ones (TP over all ranks); its gate
        # is a [1, hidden] linear every rank holds whole.
        ModuleKind("shared_expert.gate_up_proj", ShardGroup.FULL_TP, ParallelStyle.COLUMN, ("gate_proj", "up_proj"), "mlp.shared_expert"),
        ModuleKind("shared_expert.down_proj", ShardGroup.FULL_TP, ParallelStyle.ROW, ("down_proj",), "mlp.shared_expert"),
        ModuleKind("shared_expert_gate", ShardGroup.REPLICATED, ParallelStyle.REPLICATED, ("shared_expert_gate",), "mlp"),
        # DeepSeek's shared experts (plural in its module path; no gate), a full-TP MLP too.
        ModuleKind("shared_experts.gate_up_proj", ShardGroup.FULL_TP, ParallelStyle.COLUMN, ("gate_proj", "up_proj"), "mlp.shared_experts"),
        ModuleKind("shared_experts.down_proj", ShardGroup.FULL_TP, ParallelStyle.ROW, ("down_proj",), "mlp.shared_experts"),
        # MLA (DeepSeek-V2/V3): the per-head projections split by heads over the attention-TP
        # group; the two down-projections to the latents every rank of the group holds whole.
        ModuleKind("q_proj", ShardGroup.ATTN_TP, ParallelStyle.COLUMN, ("q_proj",), "self_attn"),
        ModuleKind("q_a_proj", ShardGroup.REPLICATED, ParallelStyle.REPLICATED, ("q_a_proj",), "self_attn"),
        ModuleKind("q_b_proj", ShardGroup.ATTN_TP, ParallelStyle.COLUMN, ("q_b_proj",), "self_attn"),
        ModuleKind("kv_a_proj_with_mqa", ShardGroup.REPLICATED, ParallelStyle.REPLICATED, ("kv_a_proj_with_mqa",), "self_attn"),
        ModuleKind("kv_b_proj", ShardGroup.ATTN_TP, ParallelStyle.COLUMN, ("kv_b_proj",), "self_attn"),
        # Embedding and LM head work on one attention group's tokens, so they shard like attention.
        ModuleKind("vocab", ShardGroup.ATTN_TP, ParallelStyle.VOCAB, (), "model"),
        # Which routed experts a rank holds at all (each one then split by the expert kinds above).
        ModuleKind("experts", ShardGroup.EP, ParallelStyle.EXPERTS, (), "mlp"),
    )
}
DENSE_KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
MLP_KINDS = ("gate_up_proj", "down_proj")
EXPERT_KINDS = ("experts.gate_up_proj", "experts.down_proj")
SHARED_EXPERT_KINDS = ("shared_expert.gate_up_proj", "shared_expert.down_proj", "shared_expert_gate")
DEEPSEEK_SHARED_KINDS = ("shared_experts.gate_up_proj", "shared_experts.down_proj")
MLA_Q_KINDS = ("q_proj",)
MLA_Q_LORA_KINDS = ("q_a_proj", "q_b_proj")
MLA_KV_KINDS = ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
# Kinds of the MLP position that exist only in sparse layers, beside the routed experts.
SPARSE_ONLY_KINDS = SHARED_EXPERT_KINDS + DEEPSEEK_SHARED_KINDS


def peft_to_kind(cfg: ModelConfig) -> dict[tuple[str, str], tuple[str, int]]:
    """PEFT module name (e.g. "k_proj") under a parent ("self_attn", "mlp", "mlp.experts") ->
    (engine module kind, slice index inside it), for the kinds `cfg`'s model has. (A model's
    kinds never give one PEFT name twice; q_proj is a slice of qkv_proj or MLA's own kind.)"""
    return {
        (MODULE_KINDS[name].parent, peft): (name, index)
        for name in model_kinds(cfg)
        for index, peft in enumerate(MODULE_KINDS[name].peft_modules)
    }


# The engine's key of one LoRA target: (layer, kind) for a dense module, (layer, kind, global
# expert id) for one routed expert's projection.
ModuleKey = tuple[int, str] | tuple[int, str, int]


@dataclass(frozen=True)
class Shard:
    """A split's effective group on one rank: its size and this rank's index in it."""

    group: ShardGroup
    size: int
    rank: int


def effective_shard(topology: Topology, rank: int, group: ShardGroup) -> Shard:
    """The one rule for a group's size and a rank's index in it (docs/design.md §2-§3)."""
    coords = topology.coords(rank)
    if group is ShardGroup.ATTN_TP:
        return Shard(group, topology.attn_tp_size, coords.attn_tp_rank)
    if group is ShardGroup.MOE_TP:
        return Shard(group, topology.moe_tp_size, coords.moe_tp_rank)
    if group is ShardGroup.EP:
        return Shard(group, topology.ep_size, coords.ep_rank)
    if group is ShardGroup.FULL_TP:
        return Shard(group, topology.tp_size, rank)
    return Shard(group, 1, 0)


def kind_shard(topology: Topology, rank: int, kind_name: str) -> Shard:
    """The shard of module kind `kind_name` on `rank`: its table group through `effective_shard`."""
    return effective_shard(topology, rank, MODULE_KINDS[kind_name].group)


def lora_fully_sharded(shard: Shard, fully_sharded: bool) -> bool:
    """Whether a module's LoRA runs in fully-sharded mode: only on a group wider than one rank.

    This also decides the extra collective on the shrink output (all-gather for column layers,
    all-reduce for row layers), which must exist only then (docs/design.md §3, invariant 2).
    """
    return fully_sharded and shard.size > 1


@dataclass(frozen=True)
class Span:
    """A half-open range [start, start + width) along one tensor dimension."""

    start: int
    width: int

    @property
    def stop(self) -> int:
        """One past the last index."""
        return self.start + self.width


def even_span(total: int, shard: Shard, what: str) -> Span:
    """This rank's equal part of `total`, refusing totals the group cannot split evenly."""
    if total % shard.size:
        raise TopologyError(f"{what} ({total}) is not divisible by its TP group size {shard.size}")
    width = total // shard.size
    return Span(shard.rank * width, width)


@dataclass(frozen=True)
class SliceLayout:
    """One output slice of a module on one rank, in the coordinates of the unsharded weights.

    `out` is the part of the unsharded output features (PEFT B rows) this rank computes for the
    slice; `inp` the part of the unsharded input features it reads (PEFT A columns).
    """

    peft_module: str
    out: Span
    inp: Span


@dataclass(frozen=True)
class ModuleLayout:
    """How one module is split on one rank."""

    kind: ModuleKind
    shard: Shard
    in_features: int  # unsharded
    slices: tuple[SliceLayout, ...]

    @property
    def local_out_width(self) -> int:
        """Columns of this rank's base output (column-parallel: sum of slice widths)."""
        return sum(s.out.width for s in self.slices)

    @property
    def base_shape(self) -> tuple[int, int]:
        """(out, in) of this rank's base weight: fused slices stacked on the output dim."""
        if self.kind.style is ParallelStyle.ROW:
            (only,) = self.slices
            return only.out.width, only.inp.width
        return self.local_out_width, self.in_features


def module_layout(cfg: ModelConfig, topology: Topology, rank: int, kind_name: str) -> ModuleLayout:
    """Build the layout of module `kind_name` on global rank `rank`."""
    kind = MODULE_KINDS[kind_name]
    shard = kind_shard(topology, rank, kind_name)
    if kind.name == "qkv_proj":
        return ModuleLayout(kind, shard, cfg.hidden_size, _qkv_slices(cfg, shard))
    if kind.name == "o_proj":
        # By whole heads: the rank's heads' value columns (head_dim, or MLA's v_head_dim, each).
        heads = even_span(cfg.num_heads, shard, "num_attention_heads")
        per_head = cfg.attn_out_size // cfg.num_heads
        inp = Span(heads.start * per_head, heads.width * per_head)
        return ModuleLayout(kind, shard, cfg.attn_out_size, (SliceLayout("o_proj", Span(0, cfg.hidden_size), inp),))
    if kind.name in ("q_proj", "q_b_proj", "kv_b_proj"):
        return _mla_head_layout(cfg, kind, shard)
    if kind.style is ParallelStyle.REPLICATED:  # shared_expert_gate, q_a_proj, kv_a_proj_with_mqa
        out_width = _replicated_out(cfg, kind.name)
        whole = SliceLayout(kind.peft_modules[0], Span(0, out_width), Span(0, cfg.hidden_size))
        return ModuleLayout(kind, shard, cfg.hidden_size, (whole,))
    if kind.style not in (ParallelStyle.COLUMN, ParallelStyle.ROW):
        raise ValueError(f"module kind {kind_name} has no linear layout")
    intermediate, what = _intermediate(cfg, kind.name)
    if kind.style is ParallelStyle.COLUMN:  # gate_up_proj, experts.gate_up_proj
        out = even_span(intermediate, shard, what)
        full = Span(0, cfg.hidden_size)
        return ModuleLayout(kind, shard, cfg.hidden_size, tuple(SliceLayout(m, out, full) for m in kind.peft_modules))
    inp = even_span(intermediate, shard, what)  # down_proj, experts.down_proj
    return ModuleLayout(kind, shard, intermediate, (SliceLayout("down_proj", Span(0, cfg.hidden_size), inp),))


def _replicated_out(cfg: ModelConfig, kind_name: str) -> int:
    """Output features of a module every rank holds whole."""
    if kind_name == "shared_expert_gate":
        return 1
    mla = cfg.latent()
    if kind_name == "q_a_proj":
        if mla.q_lora_rank is None:
            raise ValueError("q_lora_rank is unset: the model has no q_a_proj")
        return mla.q_lora_rank
    return mla.latent_dim


def _mla_head_layout(cfg: ModelConfig, kind: ModuleKind, shard: Shard) -> ModuleLayout:
    """q_proj / q_b_proj / kv_b_proj: output rows of the rank's heads (each head's rows contiguous)."""
    mla = cfg.latent()
    heads = even_span(cfg.num_heads, shard, "num_attention_heads")
    if kind.name == "kv_b_proj":
        per_head, in_features = mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank
    else:
        per_head = mla.qk_head_dim
        in_features = cfg.hidden_size if kind.name == "q_proj" else _replicated_out(cfg, "q_a_proj")
    out = Span(heads.start * per_head, heads.width * per_head)
    return ModuleLayout(kind, shard, in_features, (SliceLayout(kind.peft_modules[0], out, Span(0, in_features)),))


def unsharded_layout(cfg: ModelConfig, kind_name: str) -> ModuleLayout:
    """The layout of `kind_name` on a group of one: the full shapes PEFT stores for the module."""
    return module_layout(cfg, Topology(1), 0, kind_name)


def _intermediate(cfg: ModelConfig, kind_name: str) -> tuple[int, str]:
    """The intermediate width an MLP-like module kind splits, and its config name for errors."""
    if kind_name in EXPERT_KINDS:
        return cfg.experts().intermediate_size, "moe_intermediate_size"
    if kind_name in SHARED_EXPERT_KINDS:
        return cfg.experts().shared_expert_intermediate_size, "shared_expert_intermediate_size"
    if kind_name in DEEPSEEK_SHARED_KINDS:
        return cfg.experts().shared_expert_intermediate_size, "moe_intermediate_size * n_shared_experts"
    return cfg.intermediate_size, "intermediate_size"


def local_experts(cfg: ModelConfig, topology: Topology, rank: int) -> Span:
    """The routed experts (global ids) a rank holds: its expert-parallel group's share."""
    return even_span(cfg.experts().num_experts, kind_shard(topology, rank, "experts"), "num_experts")


def vocab_span(cfg: ModelConfig, topology: Topology, rank: int) -> Span:
    """A rank's rows of the vocabulary, padded so every rank holds the same number of rows.

    The last rank's span may reach past `vocab_size`; those rows are zero padding.
    """
    shard = kind_shard(topology, rank, "vocab")
    per_rank = -(-cfg.vocab_size // shard.size)
    return Span(shard.rank * per_rank, per_rank)


def model_kinds(cfg: ModelConfig) -> tuple[str, ...]:
    """The LoRA module kinds a model has: its attention's (q/k/v heads or MLA's), the dense MLP's,
    plus the expert ones for an MoE model."""
    if cfg.mla is None:
        attention: tuple[str, ...] = ("qkv_proj", "o_proj")
    else:
        attention = (MLA_Q_KINDS if cfg.mla.q_lora_rank is None else MLA_Q_LORA_KINDS) + MLA_KV_KINDS
    if not cfg.moe:
        return attention + MLP_KINDS
    if not cfg.moe.shared_expert_intermediate_size:
        shared: tuple[str, ...] = ()
    else:
        shared = SHARED_EXPERT_KINDS if cfg.moe.shared_expert_gated else DEEPSEEK_SHARED_KINDS
    return attention + MLP_KINDS + EXPERT_KINDS + shared


@dataclass(frozen=True)
class AttentionHeads:
    """The heads (indices) a rank's attention shard computes; KV heads are unreplicated indices."""

    q: Span
    kv: Span


def attention_heads(cfg: ModelConfig, topology: Topology, rank: int) -> AttentionHeads:
    """This rank's query and KV heads in its attention-TP group (MLA: its heads; `kv` is the one
    latent every rank of the group holds whole)."""
    shard = kind_shard(topology, rank, "qkv_proj")
    if cfg.mla is not None:
        return AttentionHeads(even_span(cfg.num_heads, shard, "num_attention_heads"), Span(0, 1))
    return _heads(cfg, shard)


def _heads(cfg: ModelConfig, shard: Shard) -> AttentionHeads:
    """Query heads split evenly; KV heads too, unless fewer than ranks.

    With fewer KV heads than ranks, each head is replicated over size / num_kv_heads ranks and a
    rank holds head `rank // replicas`.
    """
    q = even_span(cfg.num_heads, shard, "num_attention_heads")
    if shard.size <= cfg.num_kv_heads:
        return AttentionHeads(q, even_span(cfg.num_kv_heads, shard, "num_key_value_heads"))
    if shard.size % cfg.num_kv_heads:
        raise TopologyError(f"attention TP size {shard.size} is not a multiple of num_key_value_heads {cfg.num_kv_heads}")
    replicas = shard.size // cfg.num_kv_heads
    return AttentionHeads(q, Span(shard.rank // replicas, 1))


def _qkv_slices(cfg: ModelConfig, shard: Shard) -> tuple[SliceLayout, ...]:
    full_in = Span(0, cfg.hidden_size)
    heads = _heads(cfg, shard)
    q = Span(heads.q.start * cfg.head_dim, heads.q.width * cfg.head_dim)
    # Offsets are in the unreplicated k/v projections, as PEFT stores them.
    k = Span(heads.kv.start * cfg.head_dim, heads.kv.width * cfg.head_dim)
    return (SliceLayout("q_proj", q, full_in), SliceLayout("k_proj", k, full_in), SliceLayout("v_proj", k, full_in))


@dataclass(frozen=True)
class LoraSliceLayout:
    """The part of one PEFT adapter module (A: [r, in], B: [out, r]) a rank keeps for one slice.

    Ranks are in padded coordinates: an adapter of rank r < max_rank is zero beyond r.
    """

    peft_module: str
    a_rank: Span  # rows of padded A
    a_in: Span  # columns of A
    b_out: Span  # rows of B
    b_rank: Span  # columns of padded B


def lora_layout(layout: ModuleLayout, max_rank: int, fully_sharded: bool) -> tuple[LoraSliceLayout, ...]:
    """LoRA A/B slices of a module on a rank, for both LoRA modes (docs/design.md §3 table).

    Column-parallel: A whole (default) or split on the rank dim (fully sharded); B rows follow
    the base output shard. Row-parallel: A columns follow the base input shard; B whole
    (default) or split on its output dim (fully sharded).
    """
    shard = layout.shard
    whole_rank = Span(0, max_rank)
    sharded = lora_fully_sharded(shard, fully_sharded)
    result = []
    for s in layout.slices:
        if layout.kind.style is ParallelStyle.COLUMN:
            a_rank = even_span(max_rank, shard, "max_lora_rank") if sharded else whole_rank
            result.append(LoraSliceLayout(s.peft_module, a_rank, s.inp, s.out, whole_rank))
        elif layout.kind.style is ParallelStyle.ROW:
            b_out = even_span(s.out.width, shard, f"{s.peft_module} output") if sharded else s.out
            result.append(LoraSliceLayout(s.peft_module, whole_rank, s.inp, b_out, whole_rank))
        else:
            result.append(LoraSliceLayout(s.peft_module, whole_rank, s.inp, s.out, whole_rank))
    return tuple(result)


def validate_topology(cfg: ModelConfig, topology: Topology, max_rank: int) -> None:
    """Raise TopologyError now if any rank could not build any module (before spawning ranks)."""
    if topology.ep_size > 1 and not cfg.moe:
        raise TopologyError(f"--ep {topology.ep_size} needs a model with routed experts")
    for rank in range(topology.tp_size):
        if cfg.moe:
            local_experts(cfg, topology, rank)
        for kind_name in model_kinds(cfg):
            lora_layout(module_layout(cfg, topology, rank, kind_name), max_rank, topology.fully_sharded_loras)
