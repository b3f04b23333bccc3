"""What a rank's model is built from (`RankSetup`) and what one forward knows of its batch
(`ForwardContext`, with the paged-cache placement of its attention group's tokens)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from node_agent.engine.kernels import LoraBatch, paged_attention
from node_agent.engine.model.lora_layers import LAYER_CLASSES, LoraCapacity, LoraLinear
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.parallel.distributed import ProcessGroups
from node_agent.engine.parallel.sharding import MODULE_KINDS, module_layout
from node_agent.engine.parallel.topology import Topology
from node_agent.engine.serving.kv_cache import PagedKVCache


@dataclass(frozen=True)
class RankSetup:
    """What every module of one rank is built from."""

    cfg: ModelConfig
    topology: Topology
    rank: int
    groups: ProcessGroups
    capacity: LoraCapacity
    dtype: torch.dtype
    device: torch.device

    def lora_linear(self, kind_name: str, bias: bool) -> LoraLinear:
        """The LoRA layer of module kind `kind_name`, built with its kind's group and layout."""
        kind = MODULE_KINDS[kind_name]
        layout = module_layout(self.cfg, self.topology, self.rank, kind_name)
        return LAYER_CLASSES[kind.style](layout, self.groups.get(kind.group), self.capacity, bias, self.dtype, self.device)


@dataclass
class AttentionBatch:
    """Where this group's new tokens sit in the paged KV cache (docs/serving.md).

    Sequence `i` computes its last `query_lens[i]` of `context_lens[i]` tokens; its new tokens'
    K/V go to `slot_mapping` and it attends through row `i` of `block_tables`.
    """

    kv: PagedKVCache
    slot_mapping: torch.Tensor  # [T_group] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    query_lens: list[int]
    context_lens: list[int]

    @property
    def decode_only(self) -> bool:
        """Every sequence computes one token (a batched decode)."""
        return bool(self.query_lens) and all(n == 1 for n in self.query_lens)

    @functools.cached_property
    def first_block(self) -> int | None:
        """For a lone sequence whose blocks are consecutive, its first block (the decode then reads
        its context as a view of the cache; `paged_attention.consecutive_blocks`), found once for
        every layer."""
        return paged_attention.consecutive_blocks(self.block_tables, self.context_lens, self.kv.layout.block_size)

    @functools.cached_property
    def context_tensor(self) -> torch.Tensor:
        """`context_lens` as an int32 tensor on the cache's device, made once for every layer."""
        return torch.tensor(self.context_lens, dtype=torch.int32, device=self.slot_mapping.device)


def block_table_tensor(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """int32 `[num_seqs, max_blocks]`, short rows padded with block 0 (never read unmasked)."""
    width = max((len(t) for t in tables), default=0) or 1
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device).reshape(-1, width)


@dataclass
class ForwardContext:
    """Everything one forward needs to know about the batch, as seen from one rank."""

    group_token_counts: list[int]  # tokens of every attention group
    attn_dp_rank: int
    attn_tp_rank: int
    attn_lora: LoraBatch  # slots of this group's tokens
    mlp_lora: LoraBatch  # slots of all tokens, group-major order
    cos: torch.Tensor  # [T_group, head_dim], at each token's absolute position
    sin: torch.Tensor
    attention: AttentionBatch
    logit_rows: torch.Tensor | None = None  # rows of this group's tokens that need logits (None: all)

    @property
    def group_offset(self) -> int:
        return sum(self.group_token_counts[: self.attn_dp_rank])

    @property
    def total_tokens(self) -> int:
        return sum(self.group_token_counts)
