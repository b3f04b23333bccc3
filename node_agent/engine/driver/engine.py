"""The engine driver: starts the ranks and fans every command out to all of them.

The driver keeps the registry of adapters that every rank holds: an adapter enters it only when
all ranks loaded it (a partial load is rolled back, `node_agent.backend.all_or_nothing`), so it
is routable only when every rank can serve it. It also keeps what each rank last reported
holding: only the driver's own commands change a rank's pool, so that record is exact without
asking the ranks again. Generation and Forward go through the step loop (`step_loop`); the
ranks are reached through a transport (`transport`: processes over pipes).

Requests are checked at the agent's boundary (`node_agent.validation`); the engine checks only
its own state (which adapters are loaded).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import NoReturn, TypeVar

import torch
from torch.distributed import DistError, TCPStore

from lorafleet_common.merge import merge_failure_first
from node_agent.backend import (
    AdapterRequests,
    ControlReply,
    ControlResult,
    FileDigests,
    RankPlace,
    RankReply,
    RunningCommand,
    SequenceInput,
    ServingStats,
    WrittenFiles,
    all_or_nothing,
    already_loaded,
    merge_control,
)
from node_agent.engine.adapters.errors import AdapterLoadError
from node_agent.engine.adapters.files import verify_adapter
from node_agent.engine.adapters.memo import SpecMemo
from node_agent.engine.adapters.plan import ShardPlanner
from node_agent.engine.driver.config import EngineConfig, RankConfig
from node_agent.engine.driver.errors import EngineError, RankLoadError, RankUnloadError
from node_agent.engine.driver.faults import FaultPlan
from node_agent.engine.driver.generation import Generation
from node_agent.engine.driver.protocol import Command, Describe, DescribeReply, Load, ReadyReply, Step, StepReply, Unload
from node_agent.engine.driver.step_loop import EngineHooks, StepLoop
from node_agent.engine.driver.transport import ProcessRanks, RanksLost, RankTransport, TransportFactory
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.parallel.distributed import RENDEZVOUS_HOST, rendezvous_store
from node_agent.engine.parallel.sharding import validate_topology
from node_agent.engine.serving.sampler import SamplingParams
from node_agent.engine.serving.scheduler import Scheduler
from node_agent.engine.serving.scheduling import ScheduledStep, SchedulerConfig, SchedulerError

log = logging.getLogger(__name__)

R = TypeVar("R", bound=RankReply)


class Engine:
    """One engine instance: `tp_size` ranks in one torch.distributed world, and its step loop.

    `faults` (tests only) makes ranks misbehave; `transport` starts the ranks (default: one
    spawned process each)."""

    def __init__(self, config: EngineConfig, faults: FaultPlan | None = None, transport: TransportFactory = ProcessRanks) -> None:
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model_dir)
        scheduler_config = _checked(config, self.model_config)
        self.adapters: set[str] = set()  # loaded on every rank
        self.failure: str | None = None
        # Commands must reach every rank in the same order, and a load with its rollback must
        # not interleave with other commands: one command sequence at a time.
        self._lock = threading.RLock()
        self._ranks: RankTransport | None = None
        self._closed = False
        self._store: TCPStore | None = None  # the ranks' rendezvous, served here while they run
        self._holds: list[tuple[str, ...]] = [() for _ in range(config.topology.tp_size)]  # as each rank last said
        self._running: RunningCommand | None = None  # read without the lock (health)
        self._pinned: set[str] = set()
        # Plans every load's per-rank reads from the LoRA slices each rank reported at start-up.
        self._planner = ShardPlanner([], torch.float32)
        self._specs = SpecMemo(self.model_config, config.max_lora_rank)  # validated specs, by content
        self._steps: StepLoop | None = None
        self._start(faults, transport)
        try:
            # Every rank has the same layout, so the same budget gives the same count; the
            # minimum holds once budgets come from each device's free memory.
            self.num_kv_blocks = min(reply.kv_blocks for reply in self.describe())
        except EngineError:
            self.close()
            raise
        scheduler = Scheduler(replace(scheduler_config, num_blocks=self.num_kv_blocks))
        self._steps = StepLoop(scheduler, EngineHooks(self._run_step, lambda: self.failure, self._set_failure))

    # -- lifecycle ---------------------------------------------------------------------------

    def _start(self, faults: FaultPlan | None, transport: TransportFactory) -> None:
        config = self.config
        if config.device == "cuda" and torch.cuda.device_count() < config.topology.tp_size:
            raise EngineError(f"--tp {config.topology.tp_size} needs that many CUDA devices, found {torch.cuda.device_count()}")
        where = f"{RENDEZVOUS_HOST}:{config.master_port}"
        try:
            self._store = rendezvous_store(config.master_port)
        except OSError as error:
            reason = (error.strerror or str(error)).lower()
            raise EngineError(f"--master-port {config.master_port}: cannot listen on {where}: {reason}") from None
        except DistError as error:
            raise EngineError(f"the ranks' rendezvous store on {where} did not start: {error}") from None
        ranks = self._ranks = transport(RankConfig(config, self._store.port), faults)
        try:
            # A rank that cannot start leaves the others blocked in the rendezvous: stop at the
            # first failure instead of waiting for them.
            replies = ranks.collect(
                config.startup_timeout_s, "start", stop_on_failure=True, limit="the engine's start-up timeout, --engine-startup-timeout-s"
            )
        except RanksLost as lost:
            self.close()
            raise EngineError(str(lost)) from None
        merged = merge_failure_first(replies, lambda r: r.ok, lambda r: r.error)
        if not merged.ok:
            self.close()
            raise EngineError(merged.error)
        ready = [reply for reply in replies if isinstance(reply, ReadyReply)]
        if len(ready) != len(replies):  # a rank runs other code than this driver
            self.close()
            raise EngineError("a rank answered start with something other than a ReadyReply")
        self._planner = ShardPlanner([dict(reply.lora_layouts) for reply in ready], getattr(torch, config.torch_dtype_name))
        log.info("engine started: %s ranks, topology %s", len(replies), config.topology)

    def close(self) -> None:
        """Stop the step loop (pending generations fail), then every rank (politely, then by force)."""
        if self._steps is not None:
            self._steps.stop()
        if self._ranks is not None:
            self._ranks.close()
        self._closed = True
        self._store = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        """True while every rank runs and none has failed a call fatally."""
        return self.failure is None and not self._closed and self._ranks is not None and self._ranks.alive

    @property
    def running(self) -> RunningCommand | None:
        """The command the ranks are carrying out now (None between commands); no lock taken,
        so health can ask while a command hangs."""
        return self._running

    @property
    def pids(self) -> list[int]:
        """The rank processes' ids, in rank order (empty once closed)."""
        return [] if self._ranks is None else self._ranks.pids

    # -- control -----------------------------------------------------------------------------

    def describe(self) -> list[DescribeReply]:
        """Every rank's buffer shapes, device slots and adapters (rank order)."""
        with self._lock:
            replies = self._broadcast(Describe(), DescribeReply)
            self._record(replies)
        merged = merge_failure_first(replies, lambda r: r.ok, lambda r: r.error)
        if not merged.ok:
            raise EngineError(merged.error)
        return replies

    def load_adapter(
        self, name: str, path: Path, pinned: bool = False, expected: FileDigests | None = None, written: WrittenFiles | None = None
    ) -> ControlResult:
        """Load on every rank, or on none: a failure anywhere is rolled back everywhere
        (`RankLoadError` then carries every rank's answer).

        The adapter is validated once, here and before the command lock (`verify_adapter`:
        AdapterLoadError names what is wrong; no rank is asked). With `expected` (the digests the
        caller verified) the files must have those digests, hashed here unless they are still the
        `written` versions their writer hashed; every rank then reads exactly the verified files
        or refuses (`adapter_files`).
        """
        if name in self.adapters:
            raise AdapterLoadError(f"adapter {name!r} is already loaded")
        verified = verify_adapter(Path(path), self._specs, expected, written)
        # Every rank's read, planned once here from its layouts: a rank unpickles flat arrays
        # and copies bytes, with no per-module work of its own (docs/engine.md "Measured").
        plans = self._planner.plans(verified.spec)
        with self._lock:
            if name in self.adapters:
                raise AdapterLoadError(f"adapter {name!r} is already loaded")
            result = all_or_nothing(
                lambda: self._control([Load(name, verified.files, plan, pinned) for plan in plans]), lambda: self._roll_back(name)
            )
            if not result.ok:
                raise RankLoadError(result)
            self.adapters.add(name)
            if pinned:
                self._pinned.add(name)
                self._serving().set_pinned(self._pinned)
            return result

    def unload_adapter(self, name: str) -> ControlResult:
        """Unload from every rank (`RankUnloadError` if some failed; the name is gone either way)."""
        with self._lock:
            if name not in self.adapters:
                raise EngineError(f"adapter {name!r} is not loaded")
            # Sequences still running on it end now (the agent drained them first, boundedly).
            steps = self._serving()
            steps.abort_adapter(name)
            self._pinned.discard(name)
            steps.set_pinned(self._pinned)
            result = merge_control(self._control([Unload(name)] * self.config.topology.tp_size))
            self.adapters.discard(name)
        if not result.ok:
            raise RankUnloadError(result)
        return result

    def holding(self, name: str) -> ControlResult:
        """The answer to a load of an adapter that is already loaded, asking no rank: a rank
        succeeds if what it last reported holding includes `name`."""
        topology = self.config.topology
        with self._lock:
            holds = list(self._holds)
        places = (RankPlace(c.rank, c.attn_dp_rank, c.attn_tp_rank) for c in map(topology.coords, range(topology.tp_size)))
        return already_loaded(name, list(zip(places, holds, strict=True)))

    # -- serving -----------------------------------------------------------------------------

    def forward(self, sequences: Sequence[SequenceInput]) -> list[torch.Tensor]:
        """Logits (float32, [len(tokens), vocab]) of every sequence, in input order.

        The sequences go through the scheduler as prompt-only requests, so they share steps with
        running generations; a batch that needs more LoRA slots than there are (pinned adapters
        counted) is refused at once, as one batch always was.
        """
        self._check_loaded(sequences)
        self._check_slots(sequences)
        steps = self._serving()
        return [torch.from_numpy(logits) for logits in steps.forward(sequences)]

    def submit(self, tokens: Sequence[int], adapter: str | None, params: SamplingParams) -> Generation:
        """Queue one sequence for generation; its tokens arrive as the step loop runs it.

        Raises QueueFull when the waiting queue is full, SchedulerError for a request that can
        never fit one DP group's KV cache, EngineError for an unknown adapter or a dead engine.
        """
        self._check_loaded([SequenceInput(tokens, adapter)])
        return self._serving().submit(tokens, adapter, params)

    def serving_stats(self) -> ServingStats:
        """The step loop's counters and the scheduler's queue, running set and free blocks (also
        of a failed engine: metrics read them at every scrape)."""
        assert self._steps is not None  # built by the constructor, which failed otherwise
        return self._steps.stats(self.num_kv_blocks)

    def adapter_requests(self) -> tuple[AdapterRequests, ...]:
        """The scheduler's running and waiting sequences per adapter (asks no rank)."""
        assert self._steps is not None  # built by the constructor, which failed otherwise
        return self._steps.adapter_requests()

    def _serving(self) -> StepLoop:
        """The step loop, once the engine serves (EngineError after a failure)."""
        if self.failure:
            raise EngineError(f"engine is not serving: {self.failure}")
        assert self._steps is not None  # built by the constructor, which failed otherwise
        return self._steps

    def _run_step(self, step: ScheduledStep) -> list[StepReply]:
        with self._lock:
            return self._broadcast(Step(step.index, step.groups), StepReply)

    def _check_slots(self, sequences: Sequence[SequenceInput]) -> None:
        """A Forward batch runs together: its adapters and the pinned ones must fit the slots."""
        wanted = {s.adapter for s in sequences if s.adapter is not None}
        pinned = self._pinned - wanted
        if len(wanted) + len(pinned) > self.config.max_loras_per_batch:
            raise EngineError(
                f"no free LoRA slot: the batch needs {len(wanted)} adapters, "
                f"{self.config.max_loras_per_batch} slots (max_loras_per_batch), {len(pinned)} pinned"
            )

    def _check_loaded(self, sequences: Sequence[SequenceInput]) -> None:
        for index, sequence in enumerate(sequences):
            if sequence.adapter is not None and sequence.adapter not in self.adapters:
                raise EngineError(f"sequence {index}: adapter {sequence.adapter!r} is not loaded")

    # -- commands to the ranks ---------------------------------------------------------------

    def _control(self, commands: Sequence[Load | Unload]) -> list[ControlReply]:
        replies = self._exchange(commands, ControlReply)
        self._record(replies)
        return replies

    def _record(self, replies: Sequence[ControlReply | DescribeReply]) -> None:
        # Called under the command lock, right after the command: holdings never go back in time.
        for reply in replies:
            self._holds[reply.rank] = reply.holds

    def _roll_back(self, name: str) -> list[ControlReply]:
        # Unload is sent to every rank (commands must reach all ranks in the same order); ranks
        # that never loaded the adapter answer "not loaded".
        after = self._control([Unload(name)] * self.config.topology.tp_size)
        stuck = [later.rank for later in after if name in later.holds]
        if stuck:
            self._fail(f"rollback of {name!r} failed on ranks {stuck}")
        return after

    def _broadcast(self, command: Command, kind: type[R]) -> list[R]:
        """Send one command to every rank and collect every rank's reply, in rank order."""
        return self._exchange([command] * self.config.topology.tp_size, kind)

    def _exchange(self, commands: Sequence[Command], kind: type[R]) -> list[R]:
        """Send every rank its command (one per rank, of one kind) and collect every rank's reply,
        in rank order. Once every rank has the command, the last step's events go to the callers
        while the ranks work."""
        with self._lock:
            if self.failure:
                raise EngineError(f"engine is not serving: {self.failure}")
            if self._closed or self._ranks is None:
                raise EngineError("engine is not serving: it was closed")
            first = commands[0]
            what = type(first).__name__.lower()
            self._running = RunningCommand(what, first.name if isinstance(first, (Load, Unload)) else None, time.monotonic())
            try:
                self._ranks.send(commands)
                if self._steps is not None:
                    self._steps.deliver()
                replies = self._ranks.collect(self.config.call_timeout_s, what)
            except RanksLost as lost:
                self._fail(str(lost))
            finally:
                self._running = None
        typed = [reply for reply in replies if isinstance(reply, kind)]
        if len(typed) != len(replies):  # a rank runs other code than this driver
            self._fail(f"a rank answered {what} with something other than a {kind.__name__}")
        return typed

    def _set_failure(self, reason: str) -> None:
        self.failure = self.failure or reason

    def _fail(self, reason: str) -> NoReturn:
        self.failure = reason
        raise EngineError(reason)


def _checked(config: EngineConfig, model: ModelConfig) -> SchedulerConfig:
    """Refuse a config the engine cannot run (EngineError); the scheduler's config it makes."""
    validate_topology(model, config.topology, config.max_lora_rank)
    if config.max_lora_rank < 1 or config.max_loras_per_batch < 1 or config.max_loaded_loras < 1:
        raise EngineError("max_lora_rank, max_loras_per_batch and max_loaded_loras must be at least 1")
    if config.cpu_threads is not None and config.cpu_threads < 1:
        raise EngineError(f"cpu_threads must be at least 1, got {config.cpu_threads}")
    if config.gpu_memory_utilization is not None:
        if config.device != "cuda":
            raise EngineError(f"gpu_memory_utilization needs device cuda, not {config.device}; use kv_cache_bytes")
        if not 0 < config.gpu_memory_utilization <= 1:
            raise EngineError(f"gpu_memory_utilization must be in (0, 1], got {config.gpu_memory_utilization}")
    try:
        return SchedulerConfig(
            num_blocks=1,  # the ranks' count, once they started
            block_size=config.block_size,
            dp_size=config.topology.dp_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_loras_per_batch=config.max_loras_per_batch,
            max_waiting=config.max_waiting,
            prefix_caching=config.prefix_caching,
        )
    except SchedulerError as error:
        raise EngineError(str(error)) from None
