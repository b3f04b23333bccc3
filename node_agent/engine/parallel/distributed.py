"""torch.distributed setup for one rank, and the few collectives the model uses.

Every collective takes its group explicitly; which group a module uses comes from
`sharding.effective_shard`, never from a global.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from node_agent.engine.parallel.sharding import ShardGroup
from node_agent.engine.parallel.topology import Topology


@dataclass
class ProcessGroups:
    """The groups one rank belongs to. `None` stands for a group of size 1 (no communication)."""

    groups: dict[ShardGroup, dist.ProcessGroup | None]

    def get(self, group: ShardGroup) -> dist.ProcessGroup | None:
        return self.groups[group]


RENDEZVOUS_HOST = "127.0.0.1"
# Every rank of an engine runs on one host: gloo's pairs listen on loopback, not on the address
# the host name resolves to (a pod's IP in Kubernetes), where anyone could reach them.
LOOPBACK_INTERFACE = "lo"


# The driver's own handle on the store only connects to its server once, at creation (it never
# waits on a key): the ranks' handles carry the engine's start-up timeout.
_SELF_CONNECT = timedelta(seconds=60)


def rendezvous_store(port: int) -> dist.TCPStore:
    """The store the ranks meet at, served by the engine's driver on loopback `port` (0: one the
    kernel picks; `.port` says which). Raises OSError when the port cannot be bound, DistError
    when the store cannot start on it.

    The driver binds the socket itself and hands it to the store: the port is held from its
    choice until the ranks are gone, so no other process can take it in between; and it is bound
    to loopback only, where a store of torch's own making listens on every address.
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((RENDEZVOUS_HOST, port))
        listener.listen()
        bound = listener.getsockname()[1]
    except OSError:
        listener.close()
        raise
    # The store owns the descriptor from this call on, and closes it (even when the call fails).
    return dist.TCPStore(
        RENDEZVOUS_HOST, bound, is_master=True, wait_for_workers=False, timeout=_SELF_CONNECT, master_listen_fd=listener.detach()
    )


def init_process_groups(topology: Topology, rank: int, store_port: int, backend: str, timeout_s: float) -> ProcessGroups:
    """Join the engine's world at the driver's store (`rendezvous_store`) and build every
    subgroup (all ranks create all groups, in order)."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        os.environ["GLOO_SOCKET_IFNAME"] = LOOPBACK_INTERFACE  # read when gloo makes its device
    store = dist.TCPStore(RENDEZVOUS_HOST, store_port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=topology.tp_size, timeout=timeout)
    coords = topology.coords(rank)
    attn_group = _subgroup([topology.attn_group_ranks(g) for g in range(topology.dp_size)], coords.attn_dp_rank, backend)
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
