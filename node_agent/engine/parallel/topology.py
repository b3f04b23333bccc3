"""Engine topology: how `tp_size` ranks split into DP-attention groups (docs/design.md §2).

All rank arithmetic lives here so that no other module derives a group or a rank by hand.
"""

from __future__ import annotations

from dataclasses import dataclass


class TopologyError(ValueError):
    """The requested topology is impossible (for itself, or for a model)."""


@dataclass(frozen=True)
class Topology:
    """The parallel layout of one engine instance."""

    tp_size: int
    dp_size: int = 1
    ep_size: int = 1
    fully_sharded_loras: bool = False

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise TopologyError(f"--tp must be at least 1, got {self.tp_size}")
        if self.dp_size < 1 or self.tp_size % self.dp_size:
            raise TopologyError(f"--dp {self.dp_size} must divide --tp {self.tp_size}")
        if self.ep_size < 1 or self.tp_size % self.ep_size:
            raise TopologyError(f"--ep {self.ep_size} must divide --tp {self.tp_size}")

    @property
    def attn_tp_size(self) -> int:
        """TP width inside one DP-attention group."""
        return self.tp_size // self.dp_size

    @property
    def moe_tp_size(self) -> int:
        """TP width of each routed expert."""
        return self.tp_size // self.ep_size

    def coords(self, rank: int) -> RankCoords:
        """Where global rank `rank` sits in every group."""
        if not 0 <= rank < self.tp_size:
            raise TopologyError(f"rank {rank} outside tp_size {self.tp_size}")
        return RankCoords(
            rank=rank,
            attn_dp_rank=rank // self.attn_tp_size,
            attn_tp_rank=rank % self.attn_tp_size,
            ep_rank=rank // self.moe_tp_size,
            moe_tp_rank=rank % self.moe_tp_size,
        )

    def attn_group_ranks(self, attn_dp_rank: int) -> list[int]:
        """Global ranks of one DP-attention group, in attention-TP order."""
        start = attn_dp_rank * self.attn_tp_size
        return list(range(start, start + self.attn_tp_size))

    def moe_group_ranks(self, ep_rank: int) -> list[int]:
        """Global ranks sharing one set of experts, in MoE-TP order."""
        start = ep_rank * self.moe_tp_size
        return list(range(start, start + self.moe_tp_size))


@dataclass(frozen=True)
class RankCoords:
    """One rank's position: global, in its attention group, and in its expert group."""

    rank: int
    attn_dp_rank: int
    attn_tp_rank: int
    ep_rank: int
    moe_tp_rank: int
