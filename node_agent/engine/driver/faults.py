"""Faults the tests inject into an engine's ranks: one typed plan the tests hand `Engine`.

Product configs never carry it (the CLI builds no plan); a rank started without one runs no
fault code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


class InjectedFault(Exception):
    """A failure the fault plan asked for."""


@dataclass(frozen=True)
class FaultPlan:
    """Which rank misbehaves, and how, on every load."""

    fail_load_on_rank: int | None = None  # this rank refuses every load
    # this rank sleeps `stall_load_s` at the start of every load, before it reads any adapter
    # byte (a hung load, and a window to change the files under it)
    stall_load_on_rank: int | None = None
    stall_load_s: float = 0.0

    def before_load(self, rank: int) -> None:
        """Run at the start of each load on `rank`: refuse it (`InjectedFault`) or stall it."""
        if self.fail_load_on_rank == rank:
            raise InjectedFault(f"injected load failure on rank {rank}")
        if self.stall_load_on_rank == rank:
            time.sleep(self.stall_load_s)
