"""torch.distributed setup for one rank, and the few collectives the model uses.

Every collective takes its group explicitly; which group a module uses comes from
`sharding.effective_shard`, never from a global.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from node_agent.engine.sharding import ShardGroup
from node_agent.engine.topology import Topology


@dataclass
class ProcessGroups:
    """The groups one rank belongs to. `None` stands for a group of size 1 (no communication)."""

    groups: dict[ShardGroup, dist.ProcessGroup | None]

    def get(self, group: ShardGroup) -> dist.ProcessGroup | None:
        return self.groups[group]


def init_process_groups(
    topology: Topology, rank: int, master_addr: str, master_port: int, backend: str, timeout_s: float
) -> ProcessGroups:
    """Join the engine's world and build every subgroup (all ranks create all groups, in order)."""
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=topology.tp_size,
        timeout=timedelta(seconds=timeout_s),
    )
    coords = topology.coords(rank)
    attn_group = _subgroup(
        [topology.attn_group_ranks(g) for g in range(topology.dp_size)], coords.attn_dp_rank, backend
    )
    moe_group = _subgroup([topology.moe_group_ranks(e) for e in range(topology.ep_size)], coords.ep_rank, backend)
    full = dist.group.WORLD if topology.tp_size > 1 else None
    return ProcessGroups(
        {ShardGroup.FULL_TP: full, ShardGroup.ATTN_TP: attn_group, ShardGroup.MOE_TP: moe_group, ShardGroup.REPLICATED: None}
    )


def _subgroup(all_ranks: list[list[int]], mine: int, backend: str) -> dist.ProcessGroup | None:
    # new_group is collective over the whole world: every rank creates every group.
    created = [dist.new_group(ranks, backend=backend) if len(ranks) > 1 else None for ranks in all_ranks]
    group = created[mine]
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    # new_group answers a rank outside the group with a marker instead of a group.
    raise RuntimeError(f"this rank is not a member of its own group {all_ranks[mine]}")


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over the group, in place; a no-op for a group of size 1."""
    if group is not None:
        dist.all_reduce(tensor, group=group)
    return tensor


def all_gather_last_dim(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's tensor along the last dimension, in group-rank order."""
    if group is None:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=-1)
