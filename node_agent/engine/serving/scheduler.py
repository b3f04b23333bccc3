"""The scheduler (docs/serving.md): what every DP-attention group computes at each step.

One per engine, in the driver process, pure Python. It owns the waiting queue, the running
sequences and one `BlockAllocator` per DP group, and every decision: admission, placement,
chunking, preemption. The ranks only receive the result (`ScheduledStep`), so they cannot
disagree, and the same submissions and step outcomes always give the same steps (queues and
dicts in insertion order, sets used only for membership, seeds from one seeded generator).

A step, in order:

1. LoRA slots: the pinned adapters, then the adapters of running sequences oldest first, up to
   `max_loras_per_batch`. A running sequence whose adapter does not fit (possible only after
   more adapters were pinned) sits the step out, keeping its blocks.
2. Decodes (one pending token), oldest first; then running prefills, oldest first, in chunks cut
   to the token budget and to the blocks of their group. A sequence that finds no block frees
   one by preempting its group's youngest sequence (by recompute: blocks freed, back to the
   front of the queue with its generated tokens as part of its prompt), itself if it is the
   youngest. While a sequence waits and one more may run, the running prefills leave it half of
   what the decodes left (the reserve), so a long prompt never stalls a short one beyond one
   step; what admission does not use goes back to them at the end of the step.
3. Admission, FCFS: while the sequence limit and token budget allow, a waiting request whose
   adapter fits the slots starts on the group with the most free blocks (a preempted one on its
   own group) if that group can hold its whole prompt beside the rest of the running prefills'
   prompts; a request that does not fit the blocks stops admission, so nothing passes a
   preempted sequence into the group it just left. One whose adapter does not fit waits and
   lets others pass, until it has waited `max_slot_wait_steps` steps: from then on nothing that
   holds a slot (an unpinned adapter) is admitted before it, so the running adapters drain and
   it gets one. `max_waiting` bounds the waiting requests; a Forward's sequences are one.

Not thread-safe: the driver's step loop calls it, cancellations included.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence

from node_agent.engine.serving.kv_cache import BlockAllocator
from node_agent.engine.serving.sampler import SequenceSampling, finish_reason
from node_agent.engine.serving.scheduling import (
    FinishedSequence,
    QueueFull,
    ScheduledSequence,
    ScheduledStep,
    SchedulerConfig,
    SchedulerError,
    SequenceRequest,
)
from node_agent.engine.serving.step_plan import LiveSequence, StepPlan


class Scheduler:
    """Continuous batching over the DP groups of one engine (the module docstring has the policy)."""

    def __init__(self, config: SchedulerConfig, *, seed: int = 0) -> None:
        self.config = config
        self._allocators = [
            BlockAllocator(config.num_blocks, config.block_size, prefix_caching=config.prefix_caching) for _ in range(config.dp_size)
        ]
        self._waiting: deque[LiveSequence] = deque()
        self._waiting_batches: Counter[int] = Counter()  # waiting sequences of each submission
        self._batches = itertools.count()  # submissions' ids
        self._running: dict[int, LiveSequence] = {}  # admission order: oldest first
        self._live: dict[int, LiveSequence] = {}  # waiting and running, by id
        self._pinned: frozenset[str] = frozenset()
        self._seeds = random.Random(seed)  # seeds of unseeded requests, in submission order
        self._step = 0
        self._in_flight: ScheduledStep | None = None

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission (preempted ones included)."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Sequences holding KV blocks."""
        return len(self._running)

    @property
    def has_work(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self._live)

    def adapters(self) -> tuple[frozenset[str], frozenset[str]]:
        """The adapters of the running sequences and of the waiting ones (None, the base model,
        is not an adapter), as the gateway metrics report them."""
        running = frozenset(seq.request.adapter for seq in self._running.values() if seq.request.adapter)
        waiting = frozenset(seq.request.adapter for seq in self._waiting if seq.request.adapter)
        return running, waiting

    def adapter_counts(self) -> tuple[Counter[str | None], Counter[str | None]]:
        """How many running and how many waiting sequences each adapter has (None: the base model)."""
        return Counter(seq.request.adapter for seq in self._running.values()), Counter(seq.request.adapter for seq in self._waiting)

    def free_blocks(self) -> tuple[int, ...]:
        """Each DP group's free blocks (unreferenced cached blocks count as free)."""
        return tuple(alloc.num_free_blocks for alloc in self._allocators)

    # -- requests --------------------------------------------------------------------------------

    def set_pinned(self, adapters: Iterable[str]) -> None:
        """The engine names of the pinned adapters: they hold LoRA slots whatever a step runs."""
        self._pinned = frozenset(adapters)

    def submit(self, request: SequenceRequest) -> None:
        """Queue a request for admission at a coming step (`submit_batch` of one)."""
        self.submit_batch((request,))

    def submit_batch(self, requests: Sequence[SequenceRequest]) -> None:
        """Queue requests submitted together (a Forward's sequences), all or none: every one is
        checked before any is queued. The batch is one request to `max_waiting`, whatever its
        size (the agent bounds a batch's tokens), so a large batch is admitted in waves.

        Raises QueueFull when `max_waiting` requests already wait, and SchedulerError for an id
        that is live or repeated, or a request that could not fit one group's KV cache even alone.
        """
        if not requests:
            raise SchedulerError("a batch needs at least one request")
        seen: set[int] = set()
        for request in requests:
            if request.seq_id in self._live or request.seq_id in seen:
                raise SchedulerError(f"sequence {request.seq_id} is already submitted")
            seen.add(request.seq_id)
            self._check_fits(request)
        if len(self._waiting_batches) >= self.config.max_waiting:
            raise QueueFull(f"{len(self._waiting_batches)} requests are waiting (max_waiting {self.config.max_waiting}); retry later")
        batch = next(self._batches)
        for request in requests:
            seed = request.params.seed if request.params.seed is not None else self._seeds.getrandbits(64)
            seq = LiveSequence(request, seed, list(request.prompt), since=self._step + 1, batch=batch)
            self._wait(seq)
            self._live[request.seq_id] = seq

    def _check_fits(self, request: SequenceRequest) -> None:
        """SchedulerError for a request that could not fit one group's KV cache even alone."""
        # The last generated token is never written, so a sequence holds at most this many.
        worst = len(request.prompt) + (0 if request.prompt_logits else request.params.max_tokens - 1)
        if worst > self.config.group_tokens:
            need = "" if request.prompt_logits else f" + {request.params.max_tokens} max tokens - 1"
            raise SchedulerError(
                f"sequence {request.seq_id} may need {worst} tokens of KV cache ({len(request.prompt)} prompt{need}) "
                f"but a DP group holds {self.config.group_tokens} "
                f"({self.config.num_blocks} blocks of {self.config.block_size})"
            )

    def cancel(self, seq_id: int) -> bool:
        """Drop a sequence now, waiting or running, and free its blocks; False if it is not live.

        Safe while a step is in flight: its blocks are not handed out before the next step, and
        `on_step_done` ignores the sequence.
        """
        seq = self._live.pop(seq_id, None)
        if seq is None:
            return False
        if seq_id in self._running:
            self._release(seq)
        else:
            self._unwait(seq)
        return True

    # -- steps -----------------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep:
        """Decide the next step. One step at a time: `on_step_done` must report the previous one."""
        if self._in_flight is not None:
            raise SchedulerError(f"step {self._in_flight.index} is still in flight: report it with on_step_done first")
        self._step += 1
        plan = StepPlan(self.config.max_num_batched_tokens)
        held, stalled = self._slots()
        runnable = [seq for seq in self._running.values() if seq.seq_id not in stalled]
        decodes = [seq for seq in runnable if self._pending(seq) == 1]
        prefills = [seq for seq in runnable if self._pending(seq) > 1]
        for seq in decodes:
            if seq.seq_id in self._running:  # not preempted by an older sequence meanwhile
                self._schedule_running(plan, seq)
        reserve = self._reserve(plan)
        plan.budget -= reserve
        for seq in prefills:
            if seq.seq_id in self._running:
                self._schedule_running(plan, seq)
        plan.budget += reserve
        if reserve:
            self._defer(plan, prefills)
        self._admit(plan, held)
        for seq in prefills:
            self._extend(plan, seq)
        step = self._build(plan)
        self._in_flight = step
        return step

    def on_step_done(self, step: ScheduledStep, tokens: Mapping[int, int]) -> list[FinishedSequence]:
        """Advance the step's sequences: their KV is written, and `tokens` holds the token drawn
        for each sequence that sampled. Returns the sequences that finished (stop token or
        `max_tokens`, by `sampler.finish_reason`; a Forward once its whole prompt is computed,
        with reason None), whose blocks are freed.

        A sequence cancelled while the step ran is skipped (its token, if given, is ignored).
        """
        if self._in_flight is None or step.index != self._in_flight.index:
            raise SchedulerError(f"step {step.index} is not the step in flight")
        sampled = {entry.seq_id for entry in step.sequences if entry.samples}
        unexpected = sorted(set(tokens) - sampled)
        missing = sorted(seq_id for seq_id in sampled - set(tokens) if seq_id in self._running)
        if unexpected or missing:
            raise SchedulerError(
                f"step {step.index}: tokens for sequences that did not sample {unexpected}, none for sequences that did {missing}"
            )
        self._in_flight = None
        finished: list[FinishedSequence] = []
        for entry in step.sequences:
            seq = self._running.get(entry.seq_id)
            if seq is None:
                continue
            self._allocator(seq).mark_written(seq.seq_id)
            if seq.request.prompt_logits and entry.context_len == len(seq.tokens):
                self._release(seq)
                del self._live[seq.seq_id]
                finished.append(FinishedSequence(seq.seq_id, None, ()))
            if entry.sampling is None:
                continue
            token = tokens[entry.seq_id]
            seq.tokens.append(token)
            reason = finish_reason(seq.request.params, token, seq.generated)
            if reason is not None:
                self._release(seq)
                del self._live[seq.seq_id]
                finished.append(FinishedSequence(seq.seq_id, reason, tuple(seq.tokens[len(seq.request.prompt) :])))
        return finished

    # -- running sequences -----------------------------------------------------------------------

    def _slots(self) -> tuple[set[str], set[int]]:
        """The adapters holding LoRA slots this step (pinned, then running oldest first), and
        the running sequences whose adapter found no slot."""
        held = set(self._pinned)
        stalled: set[int] = set()
        for seq in self._running.values():
            if self._fits(held, seq.request.adapter):
                self._hold(held, seq.request.adapter)
            else:
                stalled.add(seq.seq_id)
        return held, stalled

    def _fits(self, held: set[str], adapter: str | None) -> bool:
        return adapter is None or adapter in held or len(held) < self.config.max_loras_per_batch

    @staticmethod
    def _hold(held: set[str], adapter: str | None) -> None:
        if adapter is not None:
            held.add(adapter)

    def _schedule_running(self, plan: StepPlan, seq: LiveSequence) -> None:
        """The next chunk of a running sequence: its pending tokens, cut to the budget and to
        its group's blocks (preempting the group's youngest when not one token fits)."""
        if plan.budget == 0:
            return
        while self._room(seq) == 0:
            victim = next(other for other in reversed(self._running.values()) if other.group == seq.group)
            self._preempt(plan, victim)
            if victim is seq:
                return
        self._append(plan, seq)

    def _append(self, plan: StepPlan, seq: LiveSequence) -> None:
        """Schedule a running sequence's pending tokens, cut to the budget and its group's room."""
        alloc = self._allocator(seq)
        position = alloc.num_tokens(seq.seq_id)
        count = min(self._pending(seq), plan.budget, self._room(seq))
        slots = alloc.append(seq.seq_id, seq.tokens[position : position + count])
        assert slots is not None  # cut to the room just measured
        plan.add(seq, position, slots)

    def _reserve(self, plan: StepPlan) -> int:
        """The tokens the running prefills leave to waiting sequences this step: half of what the
        decodes left, while one waits and one more may run."""
        if not self._waiting or len(self._running) >= self.config.max_num_seqs:
            return 0
        return plan.budget // 2

    def _defer(self, plan: StepPlan, prefills: list[LiveSequence]) -> None:
        """Note the blocks the rest of each running prefill's prompt needs: admission leaves them."""
        for seq in prefills:
            if seq.seq_id in self._running and self._pending(seq):
                alloc = self._allocator(seq)
                need = math.ceil(len(seq.tokens) / alloc.block_size) - len(alloc.block_table(seq.seq_id))
                assert seq.group is not None  # running sequences have one
                plan.deferred[seq.group] = plan.deferred.get(seq.group, 0) + max(0, need)

    def _extend(self, plan: StepPlan, seq: LiveSequence) -> None:
        """Give a running prefill what admission left of the budget (never preempting for it)."""
        if plan.budget and seq.seq_id in self._running and self._pending(seq) and self._room(seq):
            self._append(plan, seq)

    def _room(self, seq: LiveSequence) -> int:
        """Tokens the sequence can append now: the rest of its last block and the free blocks."""
        alloc = self._allocator(seq)
        blocks = len(alloc.block_table(seq.seq_id)) + alloc.num_free_blocks
        return blocks * alloc.block_size - alloc.num_tokens(seq.seq_id)

    def _preempt(self, plan: StepPlan, seq: LiveSequence) -> None:
        """Recompute later: free the blocks, keep the tokens (generated ones become prompt), and
        queue it first, so it is the next admitted."""
        self._release(seq)
        plan.drop(seq.seq_id)
        plan.preempted.append(seq.seq_id)
        seq.since = self._step + 1
        self._wait(seq, first=True)

    def _release(self, seq: LiveSequence) -> None:
        self._allocator(seq).free(seq.seq_id)
        del self._running[seq.seq_id]

    def _wait(self, seq: LiveSequence, first: bool = False) -> None:
        """Queue a sequence last (a submission) or first (a preempted one)."""
        if first:
            self._waiting.appendleft(seq)
        else:
            self._waiting.append(seq)
        self._waiting_batches[seq.batch] += 1

    def _unwait(self, seq: LiveSequence) -> None:
        self._waiting.remove(seq)
        self._waiting_batches[seq.batch] -= 1
        if not self._waiting_batches[seq.batch]:
            del self._waiting_batches[seq.batch]

    def _pending(self, seq: LiveSequence) -> int:
        """Tokens of a running sequence that have no KV yet (1 for a decode)."""
        return len(seq.tokens) - self._allocator(seq).num_tokens(seq.seq_id)

    def _allocator(self, seq: LiveSequence) -> BlockAllocator:
        assert seq.group is not None  # only sequences admitted once have a group
        return self._allocators[seq.group]

    # -- admission -------------------------------------------------------------------------------

    def _admit(self, plan: StepPlan, held: set[str]) -> None:
        """Start waiting sequences, FCFS, within the limits (the module docstring has the rules)."""
        slot_aged = False  # an aged request waits for a slot: nothing that holds one passes it
        for seq in list(self._waiting):
            if len(self._running) >= self.config.max_num_seqs or plan.budget == 0:
                return
            adapter = seq.request.adapter
            if slot_aged and adapter is not None and adapter not in self._pinned:
                continue
            if not self._fits(held, adapter):
                slot_aged = slot_aged or self._step - seq.since >= self.config.max_slot_wait_steps
                continue
            group = seq.group if seq.group is not None else self._place(plan)
            # Room for the whole prompt, though it may be computed in chunks (cache hits only
            # lower the need), beside what the running prefills cut by the reserve still need.
            if math.ceil(len(seq.tokens) / self.config.block_size) > self._free(plan, group):
                return
            self._hold(held, adapter)
            self._start(plan, seq, group)

    def _place(self, plan: StepPlan) -> int:
        """The group with the most free blocks, the lower one on ties."""
        return max(range(self.config.dp_size), key=lambda group: (self._free(plan, group), -group))

    def _free(self, plan: StepPlan, group: int) -> int:
        """A group's free blocks that this step's admission may take."""
        return self._allocators[group].num_free_blocks - plan.deferred.get(group, 0)

    def _start(self, plan: StepPlan, seq: LiveSequence, group: int) -> None:
        """Admit a sequence on `group`: claim its cached prefix and schedule its first chunk."""
        self._unwait(seq)
        seq.group = group
        alloc = self._allocators[group]
        cached = alloc.add(seq.seq_id, seq.request.adapter, seq.tokens, reuse=not seq.request.prompt_logits)
        self._running[seq.seq_id] = seq
        slots = alloc.append(seq.seq_id, seq.tokens[cached : cached + min(len(seq.tokens) - cached, plan.budget)])
        assert slots is not None  # the group had free blocks for the whole prompt
        plan.add(seq, cached, slots)

    # -- the step's description ------------------------------------------------------------------

    def _build(self, plan: StepPlan) -> ScheduledStep:
        groups: list[list[ScheduledSequence]] = [[] for _ in range(self.config.dp_size)]
        for seq, position, slots in plan.chunks.values():
            assert seq.group is not None  # scheduled sequences run
            end = position + len(slots)
            samples = end == len(seq.tokens) and not seq.request.prompt_logits
            sampling = SequenceSampling(seq.request.params, seq.seed, seq.generated) if samples else None
            groups[seq.group].append(
                ScheduledSequence(
                    seq_id=seq.seq_id,
                    adapter=seq.request.adapter,
                    token_ids=tuple(seq.tokens[position:end]),
                    position=position,
                    slots=tuple(slots),
                    block_table=self._allocators[seq.group].block_table(seq.seq_id),
                    sampling=sampling,
                    logits=seq.request.prompt_logits,
                )
            )
        return ScheduledStep(self._step, tuple(tuple(group) for group in groups), tuple(plan.preempted))
