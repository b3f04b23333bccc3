"""How the driver reaches its ranks: one interface, `RankTransport`, and its implementation over
spawned processes and pipes, `ProcessRanks`.

A transport sends each rank its command and collects one reply per rank, in rank order; a rank
that is gone or a deadline that passes is `RanksLost`, which fails the engine. A rank that exits
before every rank answered fails the command even if it had answered success: a command
succeeds only on ranks that are still there when it completes. An in-process
transport (ranks as objects answering `RankWorker.run`) implements the same interface.
"""

from __future__ import annotations

import contextlib
import pickle
import select
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess
from multiprocessing.reduction import ForkingPickler
from typing import NoReturn, Protocol

import torch.multiprocessing as mp

from node_agent.backend import RankReply
from node_agent.engine.driver.config import RankConfig
from node_agent.engine.driver.faults import FaultPlan
from node_agent.engine.driver.protocol import Command, Shutdown, Step
from node_agent.engine.driver.worker import rank_main


class RanksLost(Exception):
    """A rank is gone or did not answer in time; the message says which and during what."""


class RankTransport(Protocol):
    """The ranks of one engine, as the driver talks to them."""

    def send(self, commands: Sequence[Command]) -> None:
        """Send each rank its command (rank order); `RanksLost` if a rank is gone."""
        ...

    def collect(self, timeout_s: float, what: str, stop_on_failure: bool = False, limit: str = "") -> list[RankReply]:
        """One reply per rank, rank order. With `stop_on_failure`, the replies so far once one
        of them is a failure. `RanksLost` when a rank exits before the last reply (also one that
        had answered success) or `timeout_s` passes (`limit` names the setting the deadline
        comes from)."""
        ...

    @property
    def alive(self) -> bool:
        """True while every rank runs."""
        ...

    @property
    def pids(self) -> list[int]:
        """The rank processes' ids, rank order (empty for ranks that are no processes, or closed)."""
        ...

    def close(self) -> None:
        """Stop every rank: politely, then by force."""
        ...


#: Builds an engine's transport: its ranks started with this config (and, in tests, faults).
TransportFactory = Callable[[RankConfig, FaultPlan | None], RankTransport]


class ProcessRanks:
    """Each rank a spawned process with a pipe to the driver."""

    def __init__(self, config: RankConfig, faults: FaultPlan | None = None) -> None:
        context = mp.get_context("spawn")
        self._processes: list[SpawnProcess] = []
        self._conns: list[Connection] = []
        for rank in range(config.engine.topology.tp_size):
            parent, child = context.Pipe()
            process = context.Process(target=rank_main, args=(config, rank, child, faults), daemon=True, name=f"lorafleet-rank{rank}")
            process.start()
            child.close()
            self._processes.append(process)
            self._conns.append(parent)

    def send(self, commands: Sequence[Command]) -> None:
        for rank, (conn, payload) in enumerate(zip(self._conns, _payloads(commands), strict=True)):
            try:
                conn.send_bytes(payload)
            except (BrokenPipeError, OSError) as error:
                raise RanksLost(f"rank {rank} is gone ({error})") from None

    def collect(self, timeout_s: float, what: str, stop_on_failure: bool = False, limit: str = "") -> list[RankReply]:
        deadline = time.monotonic() + timeout_s
        replies: list[RankReply | None] = [None] * len(self._conns)
        while any(r is None for r in replies):
            if stop_on_failure and any(r is not None and not r.ok for r in replies):
                break
            pending = {self._conns[i]: i for i, r in enumerate(replies) if r is None}
            # Ranks that answered success are watched too: one that exits before the command
            # completes takes its answer with it (what it held is gone), so the command fails.
            sentinels = {p.sentinel: rank for rank, p in enumerate(self._processes) if _may_be_lost(replies[rank])}
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                setting = f" ({limit})" if limit else ""
                raise RanksLost(f"{what} timed out after {timeout_s:g}s{setting} waiting for ranks {sorted(pending.values())}")
            ready = _readable([*(conn.fileno() for conn in pending), *sentinels], remaining)
            for conn, rank in pending.items():
                if conn.fileno() in ready:
                    try:
                        replies[rank] = conn.recv()
                    except (EOFError, OSError):
                        self._rank_exited(rank, what)
            for sentinel, rank in sentinels.items():
                # A reply still queued is read on the next turn (a success then counts as lost);
                # once read, the pipe of an exited rank reads as ready (its end), so only a rank
                # that has not answered is asked for one.
                if sentinel in ready and _may_be_lost(replies[rank]) and (replies[rank] is not None or not self._conns[rank].poll()):
                    self._rank_exited(rank, what)
        # The last answer may have come with a death not yet seen by the poll above.
        for rank in self._exited_after_success(replies):
            self._rank_exited(rank, what)
        return [reply for reply in replies if reply is not None]

    @property
    def alive(self) -> bool:
        return bool(self._processes) and all(p.is_alive() for p in self._processes)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes if p.pid is not None]

    def close(self) -> None:
        for conn, process in zip(self._conns, self._processes, strict=True):
            if process.is_alive():
                with contextlib.suppress(BrokenPipeError, OSError):
                    conn.send(Shutdown())
        deadline = time.monotonic() + 10
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self._conns:
            conn.close()
        self._processes, self._conns = [], []

    def _exited_after_success(self, replies: Sequence[RankReply | None]) -> list[int]:
        """The ranks that answered success and have exited since. Their sentinels say so whoever
        reaped them: `is_alive()` reads a child that another thread (the health watcher) is
        reaping at that moment as alive."""
        answered = {self._processes[rank].sentinel: rank for rank, reply in enumerate(replies) if reply is not None and reply.ok}
        return sorted(answered[sentinel] for sentinel in _readable(list(answered), 0))

    def _rank_exited(self, rank: int, what: str) -> NoReturn:
        self._processes[rank].join(1)
        raise RanksLost(f"rank {rank} exited during {what} (exit code {self._processes[rank].exitcode})")


def _may_be_lost(reply: RankReply | None) -> bool:
    """Whether a rank's exit now would leave the command without its answer: it has not answered,
    or it answered success (a rank that answered failure, a failed start, keeps its answer)."""
    return reply is None or reply.ok


def _payloads(commands: Sequence[Command]) -> list[bytes | memoryview]:
    """Each rank's pickled command. One command for every rank is pickled once (what
    Connection.send does per rank); a Step or a Load holds plain data only: plain pickle, without
    ForkingPickler's per-call copy of its reducer tables. Per-rank commands are a load's, each
    with its own plan (about 8 KiB; all four plans in one command were 33 KiB for every rank to
    unpickle)."""
    first = commands[0]
    if all(command is first for command in commands):
        payload = pickle.dumps(first, pickle.HIGHEST_PROTOCOL) if isinstance(first, Step) else ForkingPickler.dumps(first)
        return [payload] * len(commands)
    return [pickle.dumps(command, pickle.HIGHEST_PROTOCOL) for command in commands]


def _readable(fds: Sequence[int], timeout_s: float) -> set[int]:
    """The descriptors of `fds` readable (or closed) within `timeout_s`: one poll(2) call, without
    the selector objects `multiprocessing.connection.wait` builds on every call (once per step)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return {fd for fd, _ in poller.poll(timeout_s * 1000)}
