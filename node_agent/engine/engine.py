"""The engine driver: spawns the rank processes and fans every command out to all of them.

The driver keeps the registry of adapters that every rank holds: an adapter enters it only when
all ranks loaded it (a partial load is rolled back), so it is routable only when every rank can
serve it.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from lorafleet_common.merge import merge_failure_first
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.peft_adapter import AdapterLoadError
from node_agent.engine.sharding import validate_topology
from node_agent.engine.topology import Topology
from node_agent.engine.worker import RankReply, WorkerConfig, rank_main

log = logging.getLogger(__name__)

ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")


class EngineError(RuntimeError):
    """The engine cannot do what was asked (startup failure, dead rank, bad request)."""


class RankLoadError(AdapterLoadError):
    """Some ranks refused a load (the others rolled it back); `replies` holds every rank's answer."""

    def __init__(self, message: str, replies: list[RankReply]) -> None:
        super().__init__(message)
        self.replies = replies


class RankUnloadError(EngineError):
    """Some ranks failed an unload; `replies` holds every rank's answer."""

    def __init__(self, message: str, replies: list[RankReply]) -> None:
        super().__init__(message)
        self.replies = replies


@dataclass(frozen=True)
class EngineConfig:
    """How to build an engine; the CLI flags map one to one onto these fields."""

    model_dir: Path
    topology: Topology
    max_lora_rank: int = 16
    max_loras_per_batch: int = 4
    max_loaded_loras: int = 32
    device: str = "cpu"
    dtype: str | None = None  # default: float32 on CPU, bfloat16 on CUDA
    master_port: int = 0  # 0: pick a free loopback port
    startup_timeout_s: float = 300.0
    call_timeout_s: float = 300.0
    fault_fail_load_on_rank: int | None = None  # test-only fault hook


@dataclass(frozen=True)
class SequenceInput:
    """One sequence of a forward batch; `adapter` None means the base model."""

    tokens: list[int]
    adapter: str | None = None


@dataclass(frozen=True)
class LoadedAdapter:
    path: Path
    pinned: bool


class Engine:
    """One engine instance: `tp_size` rank processes in one torch.distributed world."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model_dir)
        validate_topology(self.model_config, config.topology, config.max_lora_rank)
        if config.max_lora_rank < 1 or config.max_loras_per_batch < 1 or config.max_loaded_loras < 1:
            raise EngineError("max_lora_rank, max_loras_per_batch and max_loaded_loras must be at least 1")
        self.adapters: dict[str, LoadedAdapter] = {}
        self.failure: str | None = None
        # Commands must reach every rank in the same order, and a load with its rollback must
        # not interleave with other commands: one command sequence at a time.
        self._lock = threading.RLock()
        self._processes: list[mp.Process] = []
        self._conns: list[Any] = []
        self._start()

    # -- lifecycle ---------------------------------------------------------------------------

    def _start(self) -> None:
        config = self.config
        device = config.device
        if device == "cuda" and torch.cuda.device_count() < config.topology.tp_size:
            raise EngineError(f"--tp {config.topology.tp_size} needs that many CUDA devices, found {torch.cuda.device_count()}")
        worker_config = WorkerConfig(
            model_dir=Path(config.model_dir),
            topology=config.topology,
            max_lora_rank=config.max_lora_rank,
            max_loras_per_batch=config.max_loras_per_batch,
            max_loaded_loras=config.max_loaded_loras,
            device=device,
            dtype=config.dtype or ("float32" if device == "cpu" else "bfloat16"),
            master_port=config.master_port or _free_port(),
            timeout_s=config.startup_timeout_s,
            fault_fail_load_on_rank=config.fault_fail_load_on_rank,
        )
        context = mp.get_context("spawn")
        for rank in range(config.topology.tp_size):
            parent, child = context.Pipe()
            process = context.Process(target=rank_main, args=(worker_config, rank, child), daemon=True, name=f"lorafleet-rank{rank}")
            process.start()
            child.close()
            self._processes.append(process)
            self._conns.append(parent)
        try:
            # A rank that cannot start leaves the others blocked in the rendezvous: stop at the
            # first failure instead of waiting for them.
            replies = self._collect(config.startup_timeout_s, "start", stop_on_failure=True)
        except EngineError:
            self.close()
            raise
        failed = [r for r in replies if r is not None and not r.ok]
        if failed:
            self.close()
            raise EngineError(merge_failure_first(failed, lambda r: r.ok, lambda r: r.error).error)
        log.info("engine started: %s ranks, topology %s", len(replies), config.topology)

    def close(self) -> None:
        """Stop every rank (politely, then by force)."""
        for conn, process in zip(self._conns, self._processes):
            if process.is_alive():
                try:
                    conn.send(("shutdown", {}))
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + 10
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self._conns:
            conn.close()
        self._processes, self._conns = [], []

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        """True while every rank process runs and none has failed a call fatally."""
        return self.failure is None and bool(self._processes) and all(p.is_alive() for p in self._processes)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    # -- commands ----------------------------------------------------------------------------

    def call(self, command: str, **kwargs: Any) -> list[RankReply]:
        """Send one command to every rank and collect every reply (rank order)."""
        with self._lock:
            return self._call_locked(command, **kwargs)

    def _call_locked(self, command: str, **kwargs: Any) -> list[RankReply]:
        if self.failure:
            raise EngineError(f"engine is not serving: {self.failure}")
        for rank, conn in enumerate(self._conns):
            try:
                conn.send((command, kwargs))
            except (BrokenPipeError, OSError) as error:
                self._fail(f"rank {rank} is gone ({error})")
        return self._collect(self.config.call_timeout_s, command)

    def describe(self) -> list[RankReply]:
        return self.call("describe")

    def load_adapter(self, name: str, path: Path, pinned: bool = False) -> list[RankReply]:
        """Load on every rank, or on none: a failure anywhere is rolled back everywhere."""
        if not ADAPTER_NAME.match(name or ""):
            raise AdapterLoadError(f"invalid adapter name {name!r} (letters, digits, '.', '_', '-'; at most 253)")
        with self._lock:
            if name in self.adapters:
                raise AdapterLoadError(f"adapter {name!r} is already loaded")
            replies = self.call("load", name=name, path=str(path), pinned=pinned)
            merged = merge_failure_first(replies, lambda r: r.ok, lambda r: r.error)
            if not merged.ok:
                loaded = [r.rank for r in replies if r.ok]
                if loaded:
                    self._unload_on(loaded, name)
                raise RankLoadError(merged.error, replies)
            self.adapters[name] = LoadedAdapter(Path(path), pinned)
            return replies

    def unload_adapter(self, name: str) -> list[RankReply]:
        with self._lock:
            if name not in self.adapters:
                raise EngineError(f"adapter {name!r} is not loaded")
            replies = self.call("unload", name=name)
            del self.adapters[name]
        merged = merge_failure_first(replies, lambda r: r.ok, lambda r: r.error)
        if not merged.ok:
            raise RankUnloadError(merged.error, replies)
        return replies

    def forward(self, sequences: list[SequenceInput]) -> list[torch.Tensor]:
        """Logits (float32, [len(tokens), vocab]) of every sequence, in input order."""
        with self._lock:
            self._check_batch(sequences)
            replies = self.call("forward", sequences=[(list(s.tokens), s.adapter) for s in sequences])
        merged = merge_failure_first(replies, lambda r: r.ok, lambda r: r.error)
        if not merged.ok:
            raise EngineError(merged.error)
        logits: dict[int, Any] = {}
        for reply in replies:
            logits.update(reply.payload)
        return [torch.from_numpy(logits[i]) for i in range(len(sequences))]

    def _check_batch(self, sequences: list[SequenceInput]) -> None:
        if not sequences:
            raise EngineError("a forward needs at least one sequence")
        vocab = self.model_config.vocab_size
        for index, sequence in enumerate(sequences):
            if not sequence.tokens:
                raise EngineError(f"sequence {index} has no tokens")
            bad = [t for t in sequence.tokens if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise EngineError(f"sequence {index} has token id {bad[0]!r} outside the vocabulary [0, {vocab})")
            if sequence.adapter is not None and sequence.adapter not in self.adapters:
                raise EngineError(f"sequence {index}: adapter {sequence.adapter!r} is not loaded")

    def _unload_on(self, ranks: list[int], name: str) -> None:
        # Roll back a partial load. Unload is sent to every rank (commands must reach all ranks
        # in the same order); ranks that never loaded the adapter answer "not loaded".
        replies = self.call("unload", name=name)
        stuck = [r.rank for r in replies if not r.ok and r.rank in ranks]
        if stuck:
            self._fail(f"rollback of {name!r} failed on ranks {stuck}")

    # -- plumbing ----------------------------------------------------------------------------

    def _collect(self, timeout_s: float, what: str, stop_on_failure: bool = False) -> list[RankReply]:
        """Wait for one reply per rank; a rank that exits or a deadline that passes fails the engine."""
        deadline = time.monotonic() + timeout_s
        replies: list[RankReply | None] = [None] * len(self._conns)
        while any(r is None for r in replies):
            if stop_on_failure and any(r is not None and not r.ok for r in replies):
                break
            pending = {self._conns[i]: i for i, r in enumerate(replies) if r is None}
            sentinels = {self._processes[i].sentinel: i for i in pending.values()}
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._fail(f"{what} timed out after {timeout_s:.0f}s waiting for ranks {sorted(pending.values())}")
            for ready in wait([*pending, *sentinels], timeout=remaining):
                rank = pending.get(ready, sentinels.get(ready))
                if ready in pending:
                    try:
                        replies[rank] = ready.recv()
                        continue
                    except (EOFError, OSError):
                        pass
                elif replies[rank] is not None or self._conns[rank].poll():
                    continue  # the rank answered before exiting; its reply is read above
                self._processes[rank].join(1)
                self._fail(f"rank {rank} exited during {what} (exit code {self._processes[rank].exitcode})")
        return replies  # type: ignore[return-value]

    def _fail(self, reason: str) -> None:
        self.failure = reason
        raise EngineError(reason)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
