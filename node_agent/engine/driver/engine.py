"""The engine driver: spawns the rank processes and fans every command out to all of them.

The driver keeps the registry of adapters that every rank holds: an adapter enters it only when
all ranks loaded it (a partial load is rolled back), so it is routable only when every rank can
serve it. It also keeps what each rank last reported holding: only the driver's own commands
change a rank's pool, so that record is exact without asking the ranks again.

Requests are checked at the agent's boundary (`node_agent.validation`); the engine checks only
its own state (which adapters are loaded).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import pickle
import queue
import select
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import NoReturn, TypeVar

import numpy as np
import torch
import torch.multiprocessing as mp
from torch.distributed import DistError, TCPStore

from lorafleet_common.merge import merge_failure_first
from node_agent.engine.adapters.files import FileDigests, WrittenFiles, verify_adapter
from node_agent.engine.adapters.peft import AdapterLoadError, ShardPlanner, SpecMemo
from node_agent.engine.driver.protocol import (
    Command,
    ControlReply,
    ControlResult,
    Describe,
    DescribeReply,
    Load,
    RankReply,
    ReadyReply,
    Shutdown,
    Step,
    StepReply,
    Unload,
    merge_control,
    rolled_back,
)
from node_agent.engine.driver.worker import WorkerConfig, rank_main
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.parallel.distributed import RENDEZVOUS_HOST, rendezvous_store
from node_agent.engine.parallel.sharding import validate_topology
from node_agent.engine.parallel.topology import Topology
from node_agent.engine.serving.sampler import FinishReason, SamplingParams, TokenLogprobs
from node_agent.engine.serving.scheduler import ScheduledStep, Scheduler, SchedulerConfig, SchedulerError, SequenceRequest

log = logging.getLogger(__name__)

R = TypeVar("R", bound=RankReply)


class EngineError(RuntimeError):
    """The engine cannot do what was asked (startup failure, dead rank, unknown adapter)."""


class SequenceAborted(EngineError):
    """A generation ended because its adapter was unloaded under it (a drain that timed out)."""


class RankLoadError(AdapterLoadError):
    """Some ranks refused a load (the others rolled it back); `result` holds every rank's answer."""

    def __init__(self, result: ControlResult) -> None:
        super().__init__(result.error)
        self.result = result


class RankUnloadError(EngineError):
    """Some ranks failed an unload; `result` holds every rank's answer."""

    def __init__(self, result: ControlResult) -> None:
        super().__init__(result.error)
        self.result = result


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
    master_port: int = 0  # the ranks' rendezvous on loopback, served by the driver (0: a port the kernel picks)
    startup_timeout_s: float = 300.0
    call_timeout_s: float = 300.0
    fault_fail_load_on_rank: int | None = None  # test-only fault hook: this rank refuses every load
    # test-only fault hook: this rank sleeps `fault_stall_load_s` at the start of every load,
    # before it reads any adapter byte (a hung load, and a window to change the files under it)
    fault_stall_load_on_rank: int | None = None
    fault_stall_load_s: float = 0.0
    # Serving (docs/serving.md): each rank's KV cache budget, tokens per block, the scheduler's
    # per-step limits (over all DP groups), its waiting queue, and prefix caching.
    kv_cache_bytes: int = 64 << 20
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting: int = 1024
    prefix_caching: bool = False
    # torch threads of each CPU rank; None: the machine's cores divided by tp. Fewer help on a
    # machine shared with other work, where every OpenMP barrier waits for a descheduled thread.
    cpu_threads: int | None = None
    # On CUDA, each rank's KV budget from device memory instead of kv_cache_bytes: the engine may
    # use this fraction of the device (vLLM's --gpu-memory-utilization); None: kv_cache_bytes.
    gpu_memory_utilization: float | None = None


@dataclass(frozen=True)
class GeneratedStep:
    """One token of a generation, its logprobs if asked for, and why the sequence ended (None
    until its last token)."""

    token_id: int
    logprobs: TokenLogprobs | None
    finish: FinishReason | None


@dataclass(frozen=True)
class ServingStats:
    """The step loop's counters and the scheduler's state (metrics and tests)."""

    steps: int  # steps the ranks ran
    preemptions: int  # sequences preempted by recompute
    num_blocks: int  # KV blocks per DP group
    free_blocks: tuple[int, ...]  # per DP group
    running: int
    waiting: int
    running_adapters: frozenset[str]  # engine names of the adapters running sequences use
    waiting_adapters: frozenset[str]  # and of those waiting sequences ask for


@dataclass(frozen=True)
class _PromptLogits:
    """The end of a Forward's sequence: the logits of every position."""

    logits: np.ndarray


@dataclass(frozen=True)
class _Cancelled:
    """Wakes a reader blocked on a generation that `cancel` ended from another thread."""


_Event = GeneratedStep | _PromptLogits | _Cancelled | BaseException


class _Request:
    """A submitted sequence as its caller sees it: a queue of steps, then an end. A Forward's
    sequence gathers its chunks' logits in `logits` and ends with one `_PromptLogits`."""

    def __init__(self, seq_id: int, adapter: str | None, prompt_len: int = 0) -> None:
        self.seq_id = seq_id
        self.adapter = adapter
        self.prompt_len = prompt_len  # a Forward's: the rows of its logits
        # SimpleQueue: its put and get are C calls, where queue.Queue runs Python code and
        # allocates a lock per wait (the step loop puts one event per sequence and step).
        self.events: queue.SimpleQueue[_Event] = queue.SimpleQueue()
        self.logits: np.ndarray | None = None

    def add_logits(self, position: int, chunk: np.ndarray) -> None:
        """A Forward chunk's logits, at its positions (a chunk recomputed after a preemption
        overwrites the same rows)."""
        if self.logits is None:
            self.logits = np.empty((self.prompt_len, chunk.shape[1]), dtype=np.float32)
        self.logits[position : position + chunk.shape[0]] = chunk


class Generation:
    """A running `Engine.submit`: iterate `tokens()` for its steps; `cancel()` frees its blocks."""

    def __init__(self, engine: Engine, request: _Request) -> None:
        self._engine = engine
        self._request = request
        self.done = False
        self.cancelled = False  # ended by `cancel` (the caller went away), not by a finish

    @property
    def seq_id(self) -> int:
        return self._request.seq_id

    def tokens(self, poll_s: float = 0.1, cancelled: Callable[[], bool] | None = None) -> Iterator[GeneratedStep]:
        """Each generated token as its step completes; the last carries its finish reason. An
        engine failure (or the adapter unloaded under it) raises EngineError. With `cancelled`,
        checked every `poll_s` while waiting, the sequence is cancelled and the iteration ends.
        Without it the wait blocks until the next event: the reading thread is woken only when
        there is one (`cancel` from another thread puts one too), not every `poll_s`."""
        events = self._request.events
        while not self.done:
            if cancelled is None:
                event = events.get()
            else:
                try:
                    event = events.get(timeout=poll_s)
                except queue.Empty:
                    if cancelled():
                        self.cancel()
                        return
                    continue
            if isinstance(event, _Cancelled):
                return
            if isinstance(event, BaseException):
                self.done = True
                raise event
            assert isinstance(event, GeneratedStep)  # a Generation is never a Forward
            if event.finish is not None:
                self.done = True
            yield event

    def cancel(self) -> bool:
        """Drop the sequence now (waiting or running) and free its blocks; False if it had ended."""
        dropped = self._engine._cancel(self._request.seq_id)
        self.cancelled = self.cancelled or (dropped and not self.done)
        self.done = True
        self._request.events.put(_Cancelled())  # a reader blocked in tokens() returns
        return dropped


@dataclass(frozen=True)
class RunningCommand:
    """The command the ranks are carrying out now: its kind, the adapter it names, since when."""

    command: str  # "load", "unload", "step", "describe"
    adapter: str | None  # the engine name of a load's or unload's adapter
    started: float  # time.monotonic()


@dataclass(frozen=True)
class SequenceInput:
    """One sequence of a forward batch; `adapter` None means the base model."""

    tokens: Sequence[int]
    adapter: str | None = None


class Engine:
    """One engine instance: `tp_size` rank processes in one torch.distributed world."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model_dir)
        validate_topology(self.model_config, config.topology, config.max_lora_rank)
        if config.max_lora_rank < 1 or config.max_loras_per_batch < 1 or config.max_loaded_loras < 1:
            raise EngineError("max_lora_rank, max_loras_per_batch and max_loaded_loras must be at least 1")
        if config.cpu_threads is not None and config.cpu_threads < 1:
            raise EngineError(f"cpu_threads must be at least 1, got {config.cpu_threads}")
        if config.gpu_memory_utilization is not None:
            if config.device != "cuda":
                raise EngineError(f"gpu_memory_utilization needs device cuda, not {config.device}; use kv_cache_bytes")
            if not 0 < config.gpu_memory_utilization <= 1:
                raise EngineError(f"gpu_memory_utilization must be in (0, 1], got {config.gpu_memory_utilization}")
        self.adapters: set[str] = set()  # loaded on every rank
        self.failure: str | None = None
        # Commands must reach every rank in the same order, and a load with its rollback must
        # not interleave with other commands: one command sequence at a time.
        self._lock = threading.RLock()
        self._processes: list[SpawnProcess] = []
        self._conns: list[Connection] = []
        self._store: TCPStore | None = None  # the ranks' rendezvous, served here while they run
        self._holds: list[tuple[str, ...]] = [() for _ in range(config.topology.tp_size)]  # as each rank last said
        self._running: RunningCommand | None = None  # read without the lock (health)
        self._pinned: set[str] = set()
        # Plans every load's per-rank reads from the LoRA slices each rank reported at start-up.
        self._planner = ShardPlanner([], torch.float32)
        self._specs = SpecMemo(self.model_config, config.max_lora_rank)  # validated specs, by content
        # The scheduler and the requests are guarded by `_work`; only the step loop schedules.
        self._work = threading.Condition()
        self._requests: dict[int, _Request] = {}
        # The events of the last step, delivered once the next step is on its way to the ranks
        # (`_deliver`, under `_work`), so the callers' threads run while the ranks compute and
        # not against the step loop for the interpreter lock.
        self._outbox: list[tuple[_Request, _Event]] = []
        self._ids = itertools.count()
        self._steps = 0
        self._preemptions = 0
        self._stopping = False
        try:
            scheduler_config = SchedulerConfig(
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
        self._start()
        try:
            # Every rank has the same layout, so the same budget gives the same count; the
            # minimum holds once budgets come from each device's free memory.
            self.num_kv_blocks = min(reply.kv_blocks for reply in self.describe())
        except EngineError:
            self.close()
            raise
        self._scheduler = Scheduler(replace(scheduler_config, num_blocks=self.num_kv_blocks))
        self._loop = threading.Thread(target=self._step_loop, name="lorafleet-steps", daemon=True)
        self._loop.start()

    # -- lifecycle ---------------------------------------------------------------------------

    def _start(self) -> None:
        config = self.config
        device = config.device
        if device == "cuda" and torch.cuda.device_count() < config.topology.tp_size:
            raise EngineError(f"--tp {config.topology.tp_size} needs that many CUDA devices, found {torch.cuda.device_count()}")
        where = f"{RENDEZVOUS_HOST}:{config.master_port}"
        try:
            self._store = rendezvous_store(config.master_port)
        except OSError as error:
            reason = (error.strerror or str(error)).lower()
            raise EngineError(f"--master-port {config.master_port}: cannot listen on {where}: {reason}") from None
        except DistError as error:
            raise EngineError(f"the ranks' rendezvous store on {where} did not start: {error}") from None
        store_port = self._store.port
        worker_config = WorkerConfig(
            model_dir=Path(config.model_dir),
            topology=config.topology,
            max_lora_rank=config.max_lora_rank,
            max_loras_per_batch=config.max_loras_per_batch,
            max_loaded_loras=config.max_loaded_loras,
            device=device,
            dtype=config.dtype or ("float32" if device == "cpu" else "bfloat16"),
            store_port=store_port,
            timeout_s=config.startup_timeout_s,
            fault_fail_load_on_rank=config.fault_fail_load_on_rank,
            fault_stall_load_on_rank=config.fault_stall_load_on_rank,
            fault_stall_load_s=config.fault_stall_load_s,
            kv_cache_bytes=config.kv_cache_bytes,
            block_size=config.block_size,
            cpu_threads=config.cpu_threads,
            gpu_memory_utilization=config.gpu_memory_utilization,
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
            replies = self._collect(
                config.startup_timeout_s, "start", stop_on_failure=True, limit="the engine's start-up timeout, --engine-startup-timeout-s"
            )
        except EngineError:
            self.close()
            raise
        merged = merge_failure_first(replies, lambda r: r.ok, lambda r: r.error)
        if not merged.ok:
            self.close()
            raise EngineError(merged.error)
        ready = [reply for reply in replies if isinstance(reply, ReadyReply)]
        if len(ready) != len(replies):  # a rank runs other code than this driver
            self.close()
            raise EngineError("a rank answered start with something other than a ReadyReply")
        self._planner = ShardPlanner([dict(reply.lora_layouts) for reply in ready], getattr(torch, worker_config.dtype))
        log.info("engine started: %s ranks, topology %s", len(replies), config.topology)

    def close(self) -> None:
        """Stop the step loop (pending generations fail), then every rank (politely, then by force)."""
        self._stop_step_loop()
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
        self._store = None

    def _stop_step_loop(self) -> None:
        loop = getattr(self, "_loop", None)  # absent when the ranks never started
        if loop is not None:
            with self._work:
                self._stopping = True
                self._work.notify_all()
            loop.join()
            self._fail_requests(list(self._requests), EngineError("engine is not serving: it was closed"))

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        """True while every rank process runs and none has failed a call fatally."""
        return self.failure is None and bool(self._processes) and all(p.is_alive() for p in self._processes)

    @property
    def running(self) -> RunningCommand | None:
        """The command the ranks are carrying out now (None between commands); no lock taken,
        so health can ask while a command hangs."""
        return self._running

    @property
    def pids(self) -> list[int]:
        """The rank processes' ids, in rank order (empty once closed)."""
        return [p.pid for p in self._processes if p.pid is not None]

    # -- commands ----------------------------------------------------------------------------

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
            result = merge_control(self._control([Load(name, verified.files, plan, pinned) for plan in plans]))
            if not result.ok:
                if any(reply.ok for reply in result.ranks):
                    result = self._roll_back(name, result)
                raise RankLoadError(result)
            self.adapters.add(name)
            if pinned:
                self._pinned.add(name)
                with self._work:
                    self._scheduler.set_pinned(self._pinned)
            return result

    def unload_adapter(self, name: str) -> ControlResult:
        """Unload from every rank (`RankUnloadError` if some failed; the name is gone either way)."""
        with self._lock:
            if name not in self.adapters:
                raise EngineError(f"adapter {name!r} is not loaded")
            # Sequences still running on it end now (the agent drained them first, boundedly).
            with self._work:
                victims = [seq_id for seq_id, request in self._requests.items() if request.adapter == name]
                for seq_id in victims:
                    self._scheduler.cancel(seq_id)
                self._fail_requests(victims, SequenceAborted(f"adapter {name!r} was unloaded while the sequence ran"))
                self._pinned.discard(name)
                self._scheduler.set_pinned(self._pinned)
            result = merge_control(self._control(Unload(name)))
            self.adapters.discard(name)
        if not result.ok:
            raise RankUnloadError(result)
        return result

    def holding(self, name: str) -> ControlResult:
        """The answer to a load of an adapter that is already loaded, asking no rank: a rank
        succeeds if what it last reported holding includes `name`."""
        topology = self.config.topology
        replies = []
        with self._lock:
            for rank, holds in enumerate(self._holds):
                coords = topology.coords(rank)
                error = "" if name in holds else f"rank {rank} does not hold {name!r}"
                replies.append(ControlReply(rank, coords.attn_dp_rank, coords.attn_tp_rank, not error, error, holds))
        return merge_control(replies, already_loaded=True)

    def forward(self, sequences: Sequence[SequenceInput]) -> list[torch.Tensor]:
        """Logits (float32, [len(tokens), vocab]) of every sequence, in input order.

        The sequences go through the scheduler as prompt-only requests, so they share steps with
        running generations; a batch that needs more LoRA slots than there are (pinned adapters
        counted) is refused at once, as one batch always was.
        """
        self._check_loaded(sequences)
        self._check_slots(sequences)
        if self.failure:
            raise EngineError(f"engine is not serving: {self.failure}")
        requests: list[_Request] = []
        with self._work:
            if self._stopping:
                raise EngineError("engine is not serving: it was closed")
            try:
                for sequence in sequences:
                    request = _Request(next(self._ids), sequence.adapter, len(sequence.tokens))
                    self._scheduler.submit(SequenceRequest(request.seq_id, sequence.adapter, tuple(sequence.tokens), prompt_logits=True))
                    self._requests[request.seq_id] = request
                    requests.append(request)
            except SchedulerError as error:
                for request in requests:
                    self._scheduler.cancel(request.seq_id)
                    del self._requests[request.seq_id]
                raise EngineError(f"sequence {len(requests)}: {error}") from None
            self._work.notify_all()
        out: list[torch.Tensor] = []
        for request in requests:
            event = request.events.get()  # the step loop ends every request: logits or an error
            if isinstance(event, BaseException):
                for other in requests:
                    self._cancel(other.seq_id)
                raise event
            assert isinstance(event, _PromptLogits)  # a Forward's request gets nothing else
            out.append(torch.from_numpy(event.logits))
        return out

    # -- generation (the scheduler) -----------------------------------------------------------

    def submit(self, tokens: Sequence[int], adapter: str | None, params: SamplingParams) -> Generation:
        """Queue one sequence for generation; its tokens arrive as the step loop runs it.

        Raises QueueFull when the waiting queue is full, SchedulerError for a request that can
        never fit one DP group's KV cache, EngineError for an unknown adapter or a dead engine.
        """
        self._check_loaded([SequenceInput(tokens, adapter)])
        if self.failure:
            raise EngineError(f"engine is not serving: {self.failure}")
        with self._work:
            if self._stopping:
                raise EngineError("engine is not serving: it was closed")
            request = _Request(next(self._ids), adapter)
            self._scheduler.submit(SequenceRequest(request.seq_id, adapter, tuple(tokens), params))
            self._requests[request.seq_id] = request
            self._work.notify_all()
        return Generation(self, request)

    def serving_stats(self) -> ServingStats:
        """The step loop's counters and the scheduler's queue, running set and free blocks."""
        with self._work:
            running, waiting = self._scheduler.adapters()
            return ServingStats(
                self._steps,
                self._preemptions,
                self.num_kv_blocks,
                self._scheduler.free_blocks(),
                self._scheduler.num_running,
                self._scheduler.num_waiting,
                running,
                waiting,
            )

    def _cancel(self, seq_id: int) -> bool:
        with self._work:
            self._requests.pop(seq_id, None)
            return self._scheduler.cancel(seq_id)

    def _fail_requests(self, seq_ids: Sequence[int], error: BaseException) -> None:
        self._deliver()  # a sequence's tokens so far come before its error
        for seq_id in seq_ids:
            request = self._requests.pop(seq_id, None)
            if request is not None:
                request.events.put(error)

    def _deliver(self) -> None:
        """Hand the callers every event of the outbox (called under `_work`, which orders it
        with `_fail_requests`)."""
        outbox, self._outbox = self._outbox, []
        for request, event in outbox:
            request.events.put(event)

    def _step_loop(self) -> None:
        """The one thread that schedules: one step at a time, each a single command to the ranks,
        so loads and unloads interleave with generation at step boundaries."""
        try:
            self._steps_until_stopped()
        except Exception as error:  # a bug in the loop: fail loudly, never leave callers waiting
            log.error("the step loop failed", exc_info=True)
            with self._work:
                self.failure = self.failure or f"the step loop failed: {type(error).__name__}: {error}"
                self._fail_all(EngineError(f"engine is not serving: {self.failure}"))
        finally:
            with self._work:
                self._deliver()

    def _steps_until_stopped(self) -> None:
        while True:
            with self._work:
                while not self._stopping and not self._scheduler.has_work:
                    self._deliver()
                    self._work.wait()
                if self._stopping:
                    return
                step = self._scheduler.schedule()
                self._preemptions += len(step.preempted)
            tokens: dict[int, int] = {}
            logprobs: dict[int, TokenLogprobs] = {}
            logits: tuple[tuple[int, int, np.ndarray], ...] = ()
            error: EngineError | None = None
            if step.num_tokens:
                try:
                    tokens, logprobs, logits = self._run_step(step)
                except EngineError as failed:
                    error = failed
            with self._work:
                self._deliver()  # a step that failed or ran nothing: the last step's events now
                if error is not None:
                    # Nothing this step wrote is trusted: its sequences end with the error.
                    victims = [entry.seq_id for entry in step.sequences]
                    for seq_id in victims:
                        self._scheduler.cancel(seq_id)
                    self._fail_requests(victims, error)
                    tokens, logits = {}, ()
                self._step_done(step, tokens, logprobs, logits)
                if not step.num_tokens and self._scheduler.has_work:
                    self._work.wait(0.01)  # nothing runnable now (sequences waiting for a slot)
                if self.failure is not None:
                    self._fail_all(EngineError(f"engine is not serving: {self.failure}"))

    def _step_done(
        self,
        step: ScheduledStep,
        tokens: dict[int, int],
        logprobs: dict[int, TokenLogprobs],
        logits: tuple[tuple[int, int, np.ndarray], ...],
    ) -> None:
        """Report a step to the scheduler (under `_work`) and put its callers' events in the outbox."""
        for seq_id, position, chunk in logits:
            request = self._requests.get(seq_id)
            if request is not None:  # else cancelled while the step ran
                request.add_logits(position, chunk)
        finished = {f.seq_id: f.reason for f in self._scheduler.on_step_done(step, tokens)}
        outbox = self._outbox
        for seq_id, reason in finished.items():
            request = self._requests.get(seq_id)
            if reason is None and request is not None and request.logits is not None:  # a Forward's end
                outbox.append((request, _PromptLogits(request.logits)))
                del self._requests[seq_id]
        for seq_id, token in tokens.items():
            request = self._requests.get(seq_id)
            if request is None:
                continue  # cancelled while the step ran
            reason = finished.get(seq_id)
            outbox.append((request, GeneratedStep(token, logprobs.get(seq_id), reason)))
            if reason is not None:
                del self._requests[seq_id]

    def _fail_all(self, error: EngineError) -> None:
        victims = list(self._requests)
        for seq_id in victims:
            self._scheduler.cancel(seq_id)
        self._fail_requests(victims, error)

    def _run_step(self, step: ScheduledStep) -> tuple[dict[int, int], dict[int, TokenLogprobs], tuple[tuple[int, int, np.ndarray], ...]]:
        """Run one step on every rank: the tokens drawn, their logprobs, the Forward chunks' logits.
        The last step's events go to the callers once this step is sent (`_broadcast`)."""
        with self._lock:
            replies = self._broadcast(Step(step.index, step.groups), StepReply)
            self._steps += 1
        merged = merge_failure_first(replies, lambda r: r.ok, lambda r: r.error)
        if not merged.ok:
            raise EngineError(merged.error)
        tokens = {seq_id: token for reply in replies for seq_id, token in reply.tokens}
        logprobs = {seq_id: lp for reply in replies for seq_id, lp in reply.logprobs}
        return tokens, logprobs, tuple(chunk for reply in replies for chunk in reply.logits)

    def _deliver_now(self) -> None:
        with self._work:
            self._deliver()

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

    def _control(self, command: Unload | Sequence[Load]) -> list[ControlReply]:
        replies = self._broadcast_each(command, ControlReply) if isinstance(command, Sequence) else self._broadcast(command, ControlReply)
        self._record(replies)
        return replies

    def _record(self, replies: Sequence[ControlReply | DescribeReply]) -> None:
        # Called under the command lock, right after the command: holdings never go back in time.
        for reply in replies:
            self._holds[reply.rank] = reply.holds

    def _roll_back(self, name: str, result: ControlResult) -> ControlResult:
        # Unload is sent to every rank (commands must reach all ranks in the same order); ranks
        # that never loaded the adapter answer "not loaded".
        after = self._control(Unload(name))
        stuck = [later.rank for later in after if name in later.holds]
        if stuck:
            self._fail(f"rollback of {name!r} failed on ranks {stuck}")
        return rolled_back(result, after)

    # -- plumbing ----------------------------------------------------------------------------

    def _broadcast(self, command: Command, kind: type[R]) -> list[R]:
        """Send one command to every rank and collect every rank's reply, in rank order (`_exchange`)."""

        def payloads() -> list[bytes | memoryview]:
            # Pickled once for every rank (what Connection.send does per rank). A Step holds
            # plain data only: plain pickle, without ForkingPickler's per-call copy of its
            # reducer tables.
            payload = pickle.dumps(command, pickle.HIGHEST_PROTOCOL) if isinstance(command, Step) else ForkingPickler.dumps(command)
            return [payload] * len(self._conns)

        return self._exchange(command, payloads, kind)

    def _broadcast_each(self, commands: Sequence[Load], kind: type[R]) -> list[R]:
        """Send each rank its own command (rank order) and collect every rank's reply: a load,
        each rank's plan (about 8 KiB; all four plans in one command were 33 KiB for every rank
        to unpickle). A Load holds plain data only: plain pickle, as for a Step."""
        return self._exchange(commands[0], lambda: [pickle.dumps(command, pickle.HIGHEST_PROTOCOL) for command in commands], kind)

    def _exchange(self, command: Command, payloads: Callable[[], Sequence[bytes | memoryview]], kind: type[R]) -> list[R]:
        """Send every rank its payload (`payloads()`, one per rank, of `command`'s kind) and collect
        every rank's reply, in rank order. Once every rank has the command, the outbox goes to the
        callers while the ranks work."""
        with self._lock:
            if self.failure:
                raise EngineError(f"engine is not serving: {self.failure}")
            if not self._conns:
                raise EngineError("engine is not serving: it was closed")
            what = type(command).__name__.lower()
            adapter = command.name if isinstance(command, (Load, Unload)) else None
            self._running = RunningCommand(what, adapter, time.monotonic())
            try:
                for rank, (conn, payload) in enumerate(zip(self._conns, payloads(), strict=True)):
                    try:
                        conn.send_bytes(payload)
                    except (BrokenPipeError, OSError) as error:
                        self._fail(f"rank {rank} is gone ({error})")
                self._deliver_now()
                replies = self._collect(self.config.call_timeout_s, what)
            finally:
                self._running = None
        typed = [reply for reply in replies if isinstance(reply, kind)]
        if len(typed) != len(replies):  # a rank runs other code than this driver
            self._fail(f"a rank answered {what} with something other than a {kind.__name__}")
        return typed

    def _collect(self, timeout_s: float, what: str, stop_on_failure: bool = False, limit: str = "") -> list[RankReply]:
        """Wait for one reply per rank; a rank that exits or a deadline that passes fails the engine.
        With `stop_on_failure`, return the replies so far once one of them is a failure. `limit`
        names the setting the deadline comes from, in the timeout's message."""
        deadline = time.monotonic() + timeout_s
        replies: list[RankReply | None] = [None] * len(self._conns)
        while any(r is None for r in replies):
            if stop_on_failure and any(r is not None and not r.ok for r in replies):
                break
            pending = {self._conns[i]: i for i, r in enumerate(replies) if r is None}
            sentinels = {self._processes[i].sentinel: i for i in pending.values()}
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                setting = f" ({limit})" if limit else ""
                self._fail(f"{what} timed out after {timeout_s:g}s{setting} waiting for ranks {sorted(pending.values())}")
            ready = _readable([*(conn.fileno() for conn in pending), *sentinels], remaining)
            for conn, rank in pending.items():
                if conn.fileno() in ready:
                    try:
                        replies[rank] = conn.recv()
                    except (EOFError, OSError):
                        self._rank_exited(rank, what)
            for sentinel, rank in sentinels.items():
                # A rank that answered before exiting has its reply read above (or still queued).
                if sentinel in ready and replies[rank] is None and not self._conns[rank].poll():
                    self._rank_exited(rank, what)
        return [reply for reply in replies if reply is not None]

    def _rank_exited(self, rank: int, what: str) -> NoReturn:
        self._processes[rank].join(1)
        self._fail(f"rank {rank} exited during {what} (exit code {self._processes[rank].exitcode})")

    def _fail(self, reason: str) -> NoReturn:
        self.failure = reason
        raise EngineError(reason)


def _readable(fds: Sequence[int], timeout_s: float) -> set[int]:
    """The descriptors of `fds` readable (or closed) within `timeout_s`: one poll(2) call, without
    the selector objects `multiprocessing.connection.wait` builds on every call (once per step)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return {fd for fd, _ in poller.poll(timeout_s * 1000)}
