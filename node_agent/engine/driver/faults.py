"""Faults the tests inject into an engine's ranks: one typed plan the tests hand `Engine`.

Product configs never carry it (the CLI builds no plan); a rank started without one runs no
fault code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path


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
    # this rank waits at the start of every load until the file `resume_file` exists (a pause
    # that the test ends when it has done what it does meanwhile)
    pause_load_on_rank: int | None = None
    resume_file: Path | None = None
    # what the ranks did, as files a test waits for: `markers_dir/rank<N>-paused` once rank N is
    # paused in a load, `markers_dir/rank<N>-<command>` (`rank1-load`) once it answered a command
    markers_dir: Path | None = None

    def before_load(self, rank: int) -> None:
        """Run at the start of each load on `rank`: refuse it (`InjectedFault`), stall or pause it."""
        if self.fail_load_on_rank == rank:
            raise InjectedFault(f"injected load failure on rank {rank}")
        if self.stall_load_on_rank == rank:
            time.sleep(self.stall_load_s)
        if self.pause_load_on_rank == rank and self.resume_file is not None:
            self._mark(rank, "paused")
            while not self.resume_file.exists():
                time.sleep(0.01)

    def answered(self, rank: int, command: str) -> None:
        """Run once `rank` has sent its answer to a `command` ("load", "step", ...)."""
        self._mark(rank, command)

    def _mark(self, rank: int, event: str) -> None:
        if self.markers_dir is not None:
            (self.markers_dir / f"rank{rank}-{event}").touch()
