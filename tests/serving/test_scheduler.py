"""The scheduler: budgets, chunked prefill, FCFS, LoRA slots, aging, preemption, DP placement,
the bounded queue, cancellation, and no leak over a random workload.

The ranks are a test double (`FakeRanks`): the scheduler's contract is bookkeeping, so in place
of K/V each DP group stores token ids at the slots a step names, and the "model" is a
deterministic function of the context read back through the block table. A step that sends a
wrong position, slot, block table or cached prefix, or reuses a live block, makes the read-back
context differ and so changes the tokens; every run's tokens are compared with plain greedy
generation by the same function (`reference`), which never preempts.
"""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from node_agent.engine.serving.sampler import FinishReason, SamplingParams, finish_reason
from node_agent.engine.serving.scheduler import Scheduler
from node_agent.engine.serving.scheduling import (
    FinishedSequence,
    QueueFull,
    ScheduledStep,
    SchedulerConfig,
    SchedulerError,
    SequenceRequest,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
VOCAB = 50


def next_token(context: Sequence[int]) -> int:
    """The fake model: the next token as a function of every token before it and its position."""
    value = len(context)
    for position, token in enumerate(context):
        value = (value * 31 + token * (position + 7)) % 1_000_003
    return value % VOCAB


def reference(request: SequenceRequest) -> tuple[tuple[int, ...], FinishReason]:
    """Greedy generation by the fake model, one token at a time, as if alone."""
    tokens, generated = list(request.prompt), []
    while True:
        token = next_token(tokens)
        tokens.append(token)
        generated.append(token)
        reason = finish_reason(request.params, token, len(generated))
        if reason is not None:
            return tuple(generated), reason


def request(
    seq_id: int,
    prompt_len: int,
    max_tokens: int,
    adapter: str | None = None,
    *,
    prompt: Sequence[int] | None = None,
    stop: tuple[int, ...] = (),
) -> SequenceRequest:
    tokens = tuple(prompt) if prompt is not None else tuple((seq_id * 7 + i * 3) % VOCAB for i in range(prompt_len))
    return SequenceRequest(seq_id, adapter, tokens, SamplingParams(max_tokens=max_tokens, stop_token_ids=stop))


class FakeRanks:
    """What every group's ranks do with a step, with token ids for K/V: write the new tokens at
    their slots, then read each sampling sequence's context back through its block table."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.block_size = config.block_size
        self.store = [[-1] * config.group_tokens for _ in range(config.dp_size)]
        self.generated: dict[int, int] = {}

    def slot(self, table: Sequence[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def run(self, step: ScheduledStep) -> dict[int, int]:
        tokens = {}
        for store, entries in zip(self.store, step.groups, strict=True):
            for entry in entries:
                assert len(entry.slots) == len(entry.token_ids) >= 1
                for offset, (token, slot) in enumerate(zip(entry.token_ids, entry.slots, strict=True)):
                    assert slot == self.slot(entry.block_table, entry.position + offset)
                    store[slot] = token
            for entry in entries:
                if entry.sampling is None:
                    continue
                # The draw's index survives preemption: it is the count of tokens given so far.
                assert entry.sampling.index == self.generated.get(entry.seq_id, 0)
                context = [store[self.slot(entry.block_table, p)] for p in range(entry.context_len)]
                tokens[entry.seq_id] = next_token(context)
                self.generated[entry.seq_id] = entry.sampling.index + 1
        return tokens


@dataclass
class Run:
    """What a driven workload did."""

    steps: list[ScheduledStep] = field(default_factory=list)
    finished: dict[int, FinishedSequence] = field(default_factory=dict)
    first_step: dict[int, int] = field(default_factory=dict)  # first step that computed the sequence
    done_step: dict[int, int] = field(default_factory=dict)
    group_of: dict[int, int] = field(default_factory=dict)

    def preempted(self) -> list[int]:
        return [seq_id for step in self.steps for seq_id in step.preempted]


def check_step(scheduler: Scheduler, pinned: frozenset[str], step: ScheduledStep, run: Run) -> None:
    """The limits every step keeps, whatever the workload."""
    config = scheduler.config
    assert len(step.groups) == config.dp_size
    ids = [entry.seq_id for entry in step.sequences]
    assert len(ids) == len(set(ids)) <= config.max_num_seqs
    assert step.num_tokens <= config.max_num_batched_tokens
    assert len(set(step.adapters) | pinned) <= config.max_loras_per_batch
    assert scheduler.num_running <= config.max_num_seqs
    for group, entries in enumerate(step.groups):
        for entry in entries:
            assert run.group_of.setdefault(entry.seq_id, group) == group  # one group for life
            run.first_step.setdefault(entry.seq_id, step.index)


def drive(
    scheduler: Scheduler, before: Callable[[int], bool] = lambda _: False, *, pinned: frozenset[str] = frozenset(), steps: int | None = None
) -> Run:
    """Step for `steps` steps, or until nothing is left and `before(index)`, called ahead of
    each step, says that nothing more will come."""
    scheduler.set_pinned(pinned)
    ranks, run = FakeRanks(scheduler.config), Run()
    index = 0
    while True:
        index += 1
        more = before(index)
        if steps is None and not more and not scheduler.has_work:
            return run
        step = scheduler.schedule()
        check_step(scheduler, pinned, step, run)
        run.steps.append(step)
        for done in scheduler.on_step_done(step, ranks.run(step)):
            run.finished[done.seq_id] = done
            run.done_step[done.seq_id] = step.index
        if index == steps:
            return run
        assert index < 20_000, "the workload does not finish"


def assert_reference(run: Run, requests: Sequence[SequenceRequest]) -> None:
    for req in requests:
        done = run.finished[req.seq_id]
        assert (done.token_ids, done.reason) == reference(req), f"sequence {req.seq_id}"


def config(**overrides: int | bool) -> SchedulerConfig:
    values: dict[str, int | bool] = {
        "num_blocks": 64,
        "block_size": 4,
        "dp_size": 1,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 16,
        "max_loras_per_batch": 4,
        "max_waiting": 1024,
        "prefix_caching": False,
    }
    return SchedulerConfig(**(values | overrides))


# -- budgets and chunked prefill -----------------------------------------------------------------


def test_every_step_keeps_the_token_budget_and_the_sequence_limit() -> None:
    scheduler = Scheduler(config(max_num_seqs=3, max_num_batched_tokens=8))
    requests = [request(i, 1 + (i * 5) % 20, 1 + i % 6) for i in range(10)]
    for req in requests:
        scheduler.submit(req)
    run = drive(scheduler)
    assert_reference(run, requests)
    # Both limits were reached, not merely respected.
    assert max(step.num_tokens for step in run.steps) == 8
    assert max(len(step.sequences) for step in run.steps) == 3


def test_a_long_prompt_is_prefilled_in_chunks_between_decodes() -> None:
    scheduler = Scheduler(config(max_num_seqs=2, max_num_batched_tokens=4))
    decoding, long = request(0, 2, 12), request(1, 10, 2)
    scheduler.submit(decoding)
    ranks, run = FakeRanks(scheduler.config), Run()
    chunks = []
    for index in range(1, 9):
        if index == 2:
            scheduler.submit(long)
        step = scheduler.schedule()
        check_step(scheduler, frozenset(), step, run)
        (entries,) = step.groups
        if index >= 2:
            # The decode comes first with its one token; the prompt takes what the budget leaves.
            assert entries[0].seq_id == 0 and len(entries[0].token_ids) == 1 and entries[0].samples
        if index in range(2, 6):
            assert entries[1].seq_id == 1
            chunks.append((len(entries[1].token_ids), entries[1].position, entries[1].samples))
        scheduler.on_step_done(step, ranks.run(step))
    assert chunks == [(3, 0, False), (3, 3, False), (3, 6, False), (1, 9, True)]


def submit_at(scheduler: Scheduler, plan: dict[int, list[SequenceRequest]]) -> Callable[[int], bool]:
    """`drive`'s `before`: submit `plan[index]` ahead of step `index`; more come until the last."""

    def before(index: int) -> bool:
        for req in plan.get(index, []):
            scheduler.submit(req)
        return index < max(plan)

    return before


def test_a_short_prompt_submitted_during_a_long_prefill_samples_at_its_first_step() -> None:
    scheduler = Scheduler(config(max_num_batched_tokens=16))
    long, short = request(0, 200, 2), request(1, 5, 3)
    scheduler.submit(long)
    run = drive(scheduler, submit_at(scheduler, {4: [short]}))
    assert_reference(run, [long, short])
    steps = {step.index: {entry.seq_id: entry for entry in step.sequences} for step in run.steps}
    # Alone, the long prompt takes the whole budget; the short one starts at the step it was
    # submitted before, with its whole prompt, and samples there, beside the long one's chunk.
    assert [len(steps[index][0].token_ids) for index in (1, 2, 3)] == [16, 16, 16]
    assert steps[4][1].samples and len(steps[4][1].token_ids) == 5
    assert len(steps[4][0].token_ids) == 11 and not steps[4][0].samples, "the long prefill takes the rest"
    assert run.done_step[1] < run.done_step[0] and not run.preempted()
    assert all(step.num_tokens == 16 for step in run.steps if 0 in {e.seq_id for e in step.sequences} and step.index < 13)


def test_two_long_prompts_share_the_steps_and_admission_leaves_a_prefills_blocks() -> None:
    # 16 blocks of 4 per group: the first prompt's 12 blocks, the second's 3, and no room for a third.
    scheduler = Scheduler(config(num_blocks=16, max_num_batched_tokens=16))
    first, second, third = request(0, 48, 1), request(1, 12, 1), request(2, 8, 1)
    scheduler.submit(first)
    run = drive(scheduler, submit_at(scheduler, {2: [second, third]}))
    assert_reference(run, [first, second, third])
    assert not run.preempted()
    step2 = {entry.seq_id: len(entry.token_ids) for entry in run.steps[1].sequences}
    assert step2 == {0: 8, 1: 8}, "half the budget to the running prefill, the rest to the waiting one"
    assert run.first_step[2] > run.done_step[1], "the third waited for room, leaving the first prompt's blocks"


def test_a_forward_is_computed_in_chunks_with_every_logit_never_from_the_cache_and_then_ends() -> None:
    scheduler = Scheduler(config(max_num_seqs=3, max_num_batched_tokens=6, prefix_caching=True))
    shared = tuple((3 * i + 1) % VOCAB for i in range(9))
    warm = SequenceRequest(0, "a", shared, SamplingParams(max_tokens=2))
    scheduler.submit(warm)
    drive(scheduler)  # its two full blocks are now cached for adapter "a"
    forward = SequenceRequest(1, "a", shared, prompt_logits=True)
    decoding = request(2, 3, 6, "a")
    scheduler.submit(forward)
    scheduler.submit(decoding)
    run = drive(scheduler)
    chunks = [entry for step in run.steps for entry in step.sequences if entry.seq_id == 1]
    # Every position from 0 (no cache hit, though its prefix is cached), in chunks that share
    # steps with the decode, each asking for its logits and none sampling.
    assert [(e.position, len(e.token_ids)) for e in chunks] == [(0, 6), (6, 3)]
    assert all(e.logits and e.sampling is None for e in chunks)
    assert any(len(step.sequences) == 2 for step in run.steps if any(e.seq_id == 1 for e in step.sequences))
    assert run.finished[1] == FinishedSequence(1, None, ())
    assert_reference(run, [decoding])
    assert scheduler.free_blocks() == (64,) and not scheduler.has_work
    # Its KV need is its prompt only: a prompt as large as the cache fits, one token more does not.
    small = Scheduler(config(num_blocks=2))
    small.submit(SequenceRequest(3, None, tuple(range(8)), prompt_logits=True))
    with pytest.raises(SchedulerError, match=r"may need 9 tokens of KV cache \(9 prompt\) but a DP group holds 8"):
        small.submit(SequenceRequest(4, None, tuple(range(9)), prompt_logits=True))


# -- admission -----------------------------------------------------------------------------------


def test_admission_is_first_come_first_served() -> None:
    scheduler = Scheduler(config(max_num_seqs=1, max_num_batched_tokens=4))
    requests = [request(i, 3, 2) for i in (5, 3, 9, 1)]
    for req in requests:
        scheduler.submit(req)
    run = drive(scheduler)
    assert [run.first_step[r.seq_id] for r in requests] == sorted(run.first_step.values())
    assert_reference(run, requests)


def test_a_request_that_does_not_fit_the_blocks_holds_back_those_behind_it() -> None:
    # 16 tokens of cache. A holds 2 blocks and will grow; B needs 3 blocks and must wait for
    # A, and C (1 block, which would fit) must not pass B.
    scheduler = Scheduler(config(num_blocks=4, max_num_seqs=4, max_num_batched_tokens=16))
    a, b, c = request(0, 8, 5), request(1, 12, 2), request(2, 2, 2)
    for req in (a, b, c):
        scheduler.submit(req)
    run = drive(scheduler)
    assert run.first_step[0] == 1
    assert run.first_step[2] == run.first_step[1] == run.done_step[0] + 1
    assert_reference(run, [a, b, c])


def test_a_step_never_needs_more_adapters_than_slots_pinned_ones_included() -> None:
    # Two slots, one held by the pinned adapter p: one slot is left for a, b and c in turn,
    # while p and the base model run beside any of them.
    scheduler = Scheduler(config(max_loras_per_batch=2, max_num_seqs=8))
    requests = [
        request(0, 3, 4, "a"),
        request(1, 3, 3, "b"),
        request(2, 3, 6, "p"),
        request(3, 3, 6, None),
        request(4, 2, 2, "a"),
        request(5, 3, 2, "c"),
    ]
    for req in requests:
        scheduler.submit(req)
    assert scheduler.adapters() == (frozenset(), frozenset({"a", "b", "p", "c"}))  # the base is no adapter
    scheduler.set_pinned({"p"})
    scheduler.on_step_done(first := scheduler.schedule(), FakeRanks(scheduler.config).run(first))
    assert scheduler.adapters() == (frozenset({"a", "p"}), frozenset({"b", "c"}))
    scheduler = Scheduler(config(max_loras_per_batch=2, max_num_seqs=8))
    for req in requests:
        scheduler.submit(req)
    run = drive(scheduler, pinned=frozenset({"p"}))
    assert_reference(run, requests)
    assert {run.first_step[i] for i in (0, 2, 3, 4)} == {1}  # a, p, base, a again: one slot
    # b waits for every a to finish, c for b; each gets the slot the step after it frees.
    assert run.first_step[1] == max(run.done_step[0], run.done_step[4]) + 1
    assert run.first_step[5] == run.done_step[1] + 1


def test_sequences_whose_adapter_lost_its_slot_to_a_new_pin_sit_out_and_resume() -> None:
    scheduler = Scheduler(config(max_loras_per_batch=2))
    a, b = request(0, 2, 6, "a"), request(1, 2, 6, "b")
    scheduler.submit(a)
    scheduler.submit(b)
    ranks, run = FakeRanks(scheduler.config), Run()
    for index in range(1, 20):
        pinned = frozenset({"p"}) if index >= 3 else frozenset()
        scheduler.set_pinned(pinned)
        step = scheduler.schedule()
        check_step(scheduler, pinned, step, run)
        if index >= 3 and 0 not in run.done_step:
            assert step.adapters == ("a",)  # b, the younger, keeps its blocks but waits for a slot
        for done in scheduler.on_step_done(step, ranks.run(step)):
            run.finished[done.seq_id] = done
            run.done_step[done.seq_id] = step.index
    assert run.done_step[1] > run.done_step[0]
    assert_reference(run, [a, b])


@pytest.mark.parametrize("wait_steps", [5, 10**6])
def test_a_request_waiting_for_a_slot_is_not_starved(wait_steps: int) -> None:
    # One slot, and a new request of adapter a every step: a never leaves the slot unless the
    # aged b request stops new a requests from passing it. Base requests may still pass.
    scheduler = Scheduler(config(max_loras_per_batch=1, max_num_seqs=16, max_slot_wait_steps=wait_steps))
    b = request(1000, 3, 2, "b")

    def arrive(index: int) -> bool:
        if index <= 60:
            scheduler.submit(request(index, 2, 4, "a"))
            scheduler.submit(request(500 + index, 2, 2, None))
        if index == 2:
            scheduler.submit(b)
        return index < 60

    run = drive(scheduler, arrive, steps=70)
    if wait_steps == 5:
        # Aged at step 2 + 5; the a sequences admitted by then take at most 4 steps to drain.
        assert run.first_step[1000] <= 2 + 5 + 4 + 1
        assert_reference(run, [b])
        aged_wait = range(2 + 5, run.first_step[1000])
        assert any(run.first_step.get(500 + i) in aged_wait for i in aged_wait)  # base passed it
    else:
        assert run.first_step[1000] > 60  # only once the stream of a requests has stopped


# -- preemption ----------------------------------------------------------------------------------


def test_the_youngest_sequence_is_preempted_and_resumes_first_with_the_same_tokens() -> None:
    # Three blocks of two tokens: A and B start (C waits for the sequence limit), and at the
    # second step B's decode finds no block. B, the youngest, goes back to the front of the
    # queue: C, which would fit a block earlier, does not pass it.
    scheduler = Scheduler(config(num_blocks=3, block_size=2, max_num_seqs=2))
    a, b, c = request(0, 2, 5), request(1, 2, 5), request(2, 1, 1)
    for req in (a, b, c):
        scheduler.submit(req)
    run = drive(scheduler)
    assert run.first_step[1] == 1 and run.preempted() == [1]
    (preempted_at,) = [step.index for step in run.steps if step.preempted]
    resumed = next(step.index for step in run.steps[preempted_at:] if 1 in {e.seq_id for e in step.sequences})
    assert resumed == run.done_step[0] + 1 and run.first_step[2] >= resumed
    assert_reference(run, [a, b, c])


def test_a_sequence_scheduled_earlier_in_the_step_can_be_the_one_preempted() -> None:
    # P (older) sits out step 2 while a new pin takes the only slot; D (base, younger) starts.
    # At step 3 D's decode takes the last block before P's prefill resumes: P preempts D, whose
    # chunk leaves the step and gives its token back to the budget.
    scheduler = Scheduler(config(num_blocks=4, block_size=2, max_num_seqs=4, max_num_batched_tokens=4, max_loras_per_batch=1))
    p, d = request(0, 8, 1, "x"), request(1, 2, 6)
    ranks, run = FakeRanks(scheduler.config), Run()
    scheduler.submit(p)
    for index in range(1, 12):
        pinned = frozenset({"pin"}) if index == 2 else frozenset()
        scheduler.set_pinned(pinned)
        if index == 2:
            scheduler.submit(d)
        step = scheduler.schedule()
        check_step(scheduler, pinned, step, run)
        if index == 3:
            assert step.preempted == (1,) and [(e.seq_id, e.position, len(e.token_ids)) for e in step.sequences] == [(0, 4, 4)]
        for done in scheduler.on_step_done(step, ranks.run(step)):
            run.finished[done.seq_id] = done
    assert run.first_step == {0: 1, 1: 2}
    assert_reference(run, [p, d])
    assert scheduler.free_blocks() == (4,)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_under_a_tiny_block_budget_changes_no_token(prefix_caching: bool) -> None:
    shared = tuple(range(1, 9))
    requests = [request(i, 0, 4 + i % 7, ("a", None)[i % 2], prompt=(*shared[: 4 + i % 5], i)) for i in range(12)]
    runs = []
    for num_blocks in (8, 200):
        scheduler = Scheduler(config(num_blocks=num_blocks, block_size=2, max_num_seqs=6, prefix_caching=prefix_caching))
        for req in requests:
            scheduler.submit(req)
        runs.append(drive(scheduler))
        assert scheduler.free_blocks() == (num_blocks,)
    tight, roomy = runs
    assert tight.preempted() and not roomy.preempted()
    assert tight.finished == roomy.finished
    assert_reference(tight, requests)


def test_a_written_prompt_is_reused_only_by_later_sequences_of_the_same_adapter() -> None:
    scheduler = Scheduler(config(prefix_caching=True))
    prompt = tuple(range(10, 19))  # two full blocks and one token
    first = [request(0, 0, 3, prompt=prompt), request(1, 0, 3, prompt=prompt)]
    later = [request(2, 0, 3, prompt=prompt), request(3, 0, 3, "a", prompt=prompt)]
    ranks, run = FakeRanks(scheduler.config), Run()
    positions = {}
    for index in range(1, 10):
        for req in {1: first, 5: later}.get(index, []):
            scheduler.submit(req)
        step = scheduler.schedule()
        check_step(scheduler, frozenset(), step, run)
        for entry in step.sequences:
            positions.setdefault(entry.seq_id, entry.position)
        for done in scheduler.on_step_done(step, ranks.run(step)):
            run.finished[done.seq_id] = done
    # Admitted together, 0 and 1 share nothing (no block is readable before its step is done);
    # 2 starts after the cached two blocks; 3 runs another adapter and computes everything.
    assert positions == {0: 0, 1: 0, 2: 8, 3: 0}
    assert_reference(run, first + later)


# -- DP groups -----------------------------------------------------------------------------------


def test_each_sequence_is_placed_on_the_group_with_most_free_blocks_and_idle_groups_are_empty() -> None:
    scheduler = Scheduler(config(dp_size=3, num_blocks=16, block_size=4))
    ranks = FakeRanks(scheduler.config)
    scheduler.submit(request(0, 12, 30))  # group 0 (all equal: the lowest)
    step = scheduler.schedule()
    assert [len(group) for group in step.groups] == [1, 0, 0]  # idle groups run with no sequences
    scheduler.on_step_done(step, ranks.run(step))
    for seq_id, prompt_len in ((1, 4), (2, 8), (3, 2)):
        scheduler.submit(request(seq_id, prompt_len, 30))
    step = scheduler.schedule()
    # Group 0 holds 4 blocks: 1 goes to group 1 (tie with 2: the lower), 2 to group 2, and 3 to
    # group 1 again (15 free there, 14 in group 2 and 12 in group 0).
    assert [[entry.seq_id for entry in group] for group in step.groups] == [[0], [1, 3], [2]]
    scheduler.on_step_done(step, ranks.run(step))
    assert scheduler.free_blocks() == (16 - 4, 16 - 1 - 1, 16 - 2)


def test_dp_groups_keep_their_sequences_through_preemption() -> None:
    scheduler = Scheduler(config(dp_size=2, num_blocks=5, block_size=2, max_num_seqs=8))
    requests = [request(i, 1 + i % 4, 3 + i % 5, ("a", "b", None)[i % 3]) for i in range(16)]
    for req in requests:
        scheduler.submit(req)
    run = drive(scheduler)  # check_step holds every sequence to its first group
    assert run.preempted() and set(run.group_of.values()) == {0, 1}
    assert any(not group for step in run.steps for group in step.groups)
    assert_reference(run, requests)


# -- queue, cancellation, errors -----------------------------------------------------------------


def test_the_waiting_queue_is_bounded() -> None:
    scheduler = Scheduler(config(max_waiting=2, max_num_seqs=4))
    scheduler.submit(request(0, 3, 2))
    scheduler.submit(request(1, 3, 2))
    with pytest.raises(QueueFull, match=r"2 requests are waiting \(max_waiting 2\); retry later"):
        scheduler.submit(request(2, 3, 2))
    assert scheduler.num_waiting == 2
    step = scheduler.schedule()  # both admitted: the queue has room again
    assert scheduler.num_waiting == 0
    scheduler.submit(request(2, 3, 2))
    scheduler.on_step_done(step, FakeRanks(scheduler.config).run(step))


def _forward_batch(first: int, count: int, prompt_len: int = 2) -> list[SequenceRequest]:
    return [SequenceRequest(first + i, None, tuple(range(1, 1 + prompt_len)), prompt_logits=True) for i in range(count)]


def test_a_batch_is_one_request_to_the_waiting_queue_and_is_admitted_in_waves() -> None:
    scheduler = Scheduler(config(max_waiting=2, max_num_seqs=4))
    batch = _forward_batch(0, 10)
    scheduler.submit_batch(batch)
    scheduler.submit(request(100, 3, 2))
    assert scheduler.num_waiting == 11  # sequences, as the gateway metrics count them
    with pytest.raises(QueueFull, match=r"2 requests are waiting \(max_waiting 2\)"):
        scheduler.submit_batch(_forward_batch(200, 1))
    run = drive(scheduler)
    assert {seq_id for seq_id, done in run.finished.items() if done.reason is None} == {req.seq_id for req in batch}
    assert max(len(step.sequences) for step in run.steps) == 4, "the batch ran in waves of max_num_seqs"
    scheduler.submit_batch(_forward_batch(200, 1))


def test_a_batch_is_queued_whole_or_not_at_all() -> None:
    scheduler = Scheduler(config(num_blocks=4, block_size=4))  # 16 tokens of KV per group
    scheduler.submit(request(0, 3, 2))
    too_long = [*_forward_batch(10, 3), SequenceRequest(13, None, tuple(range(17)), prompt_logits=True)]
    with pytest.raises(SchedulerError, match="sequence 13 may need 17 tokens of KV cache"):
        scheduler.submit_batch(too_long)
    with pytest.raises(SchedulerError, match="sequence 0 is already submitted"):
        scheduler.submit_batch(_forward_batch(-1, 2))  # ids -1 and 0: 0 is live
    with pytest.raises(SchedulerError, match="sequence 20 is already submitted"):
        scheduler.submit_batch([SequenceRequest(20, None, (1,), prompt_logits=True)] * 2)
    assert scheduler.num_waiting == 1
    assert set(drive(scheduler).finished) == {0}


def test_cancel_frees_a_sequence_at_once_waiting_or_running() -> None:
    scheduler = Scheduler(config(num_blocks=16, max_num_seqs=2, max_num_batched_tokens=32))
    ranks = FakeRanks(scheduler.config)
    for seq_id in range(3):
        scheduler.submit(request(seq_id, 9, 8))
    step = scheduler.schedule()
    assert scheduler.free_blocks() == (16 - 6,) and scheduler.num_waiting == 1
    assert scheduler.cancel(2) and scheduler.num_waiting == 0  # waiting
    assert scheduler.cancel(0) and scheduler.free_blocks() == (16 - 3,)  # running, mid-step
    assert not scheduler.cancel(0) and not scheduler.cancel(7)
    scheduler.on_step_done(step, ranks.run(step))  # sequence 0's token is ignored
    step = scheduler.schedule()
    assert [entry.seq_id for entry in step.sequences] == [1]
    assert scheduler.cancel(1) and scheduler.free_blocks() == (16,) and not scheduler.has_work
    assert scheduler.on_step_done(step, {}) == []  # nothing left to report, and nothing missing


def test_submissions_that_cannot_be_served_are_refused_with_the_reason() -> None:
    scheduler = Scheduler(config(num_blocks=4, block_size=4))
    scheduler.submit(request(0, 3, 2))
    with pytest.raises(SchedulerError, match="sequence 0 is already submitted"):
        scheduler.submit(request(0, 3, 2))
    with pytest.raises(
        SchedulerError,
        match=r"may need 17 tokens of KV cache \(10 prompt \+ 8 max tokens - 1\) "
        r"but a DP group holds 16 \(4 blocks of 4\)",
    ):
        scheduler.submit(request(1, 10, 8))
    scheduler.submit(request(1, 10, 7))  # exactly 16: fits alone
    with pytest.raises(SchedulerError, match="prompt of sequence 2 must hold at least one token"):
        SequenceRequest(2, None, ())
    with pytest.raises(SchedulerError, match=r"max_num_batched_tokens \(2\) must be at least max_num_seqs \(4\)"):
        config(max_num_batched_tokens=2)
    with pytest.raises(SchedulerError, match=r"SchedulerConfig\.dp_size must be at least 1, got 0"):
        config(dp_size=0)


def test_step_outcomes_are_checked_before_anything_changes() -> None:
    scheduler = Scheduler(config())
    ranks = FakeRanks(scheduler.config)
    scheduler.submit(request(0, 3, 2))
    step = scheduler.schedule()
    with pytest.raises(SchedulerError, match="step 1 is still in flight"):
        scheduler.schedule()
    with pytest.raises(SchedulerError, match=r"tokens for sequences that did not sample \[4\], none for sequences that did \[0\]"):
        scheduler.on_step_done(step, {4: 1})
    assert scheduler.on_step_done(step, ranks.run(step)) == []
    with pytest.raises(SchedulerError, match="step 1 is not the step in flight"):
        scheduler.on_step_done(step, {})


def test_a_stop_token_finishes_a_sequence_before_max_tokens() -> None:
    req = request(0, 3, 10)
    first = reference(req)[0][0]
    stopping = request(0, 3, 10, stop=(first,))
    scheduler = Scheduler(config())
    scheduler.submit(stopping)
    run = drive(scheduler)
    assert run.finished[0] == FinishedSequence(0, FinishReason.STOP, (first,))


# -- the whole: no leak, determinism -------------------------------------------------------------


def random_workload(scheduler: Scheduler, rng: random.Random, count: int) -> tuple[Callable[[int], bool], list[SequenceRequest], set[int]]:
    """`count` mixed requests arriving a few per step (held back while the queue is full),
    some cancelled while waiting or running; prompts share prefixes so that the cache is hit."""
    prefixes = [tuple(rng.randrange(VOCAB) for _ in range(12)) for _ in range(4)]
    adapters = (None, None, "a", "b", "c", "d", "p")
    requests = []
    for seq_id in range(count):
        prompt = rng.choice(prefixes)[: rng.randrange(13)] + tuple(rng.randrange(VOCAB) for _ in range(rng.randrange(1, 10)))
        params = SamplingParams(max_tokens=rng.randrange(1, 10), stop_token_ids=(rng.randrange(VOCAB),))
        requests.append(SequenceRequest(seq_id, rng.choice(adapters), prompt, params))
    backlog, cancelled = list(reversed(requests)), set()

    def before(_: int) -> bool:
        for _ in range(rng.randrange(6)):
            if not backlog:
                break
            try:
                scheduler.submit(backlog[-1])
            except QueueFull:
                break
            backlog.pop()
        submitted = len(requests) - len(backlog)
        if submitted and rng.random() < 0.3:
            seq_id = rng.randrange(max(0, submitted - 20), submitted)  # recent ones: most are live
            if scheduler.cancel(seq_id):
                cancelled.add(seq_id)
        return bool(backlog)

    return before, requests, cancelled


def random_config() -> SchedulerConfig:
    return config(
        dp_size=2,
        num_blocks=12,
        block_size=3,
        max_num_seqs=6,
        max_num_batched_tokens=12,
        max_loras_per_batch=3,
        max_waiting=20,
        max_slot_wait_steps=4,
        prefix_caching=True,
    )


def test_a_random_workload_with_cancellations_leaves_every_block_free() -> None:
    scheduler = Scheduler(random_config())
    before, requests, cancelled = random_workload(scheduler, random.Random(9), 1000)
    run = drive(scheduler, before, pinned=frozenset({"p"}))
    assert scheduler.free_blocks() == (12, 12)
    assert scheduler.num_waiting == scheduler.num_running == 0 and not scheduler.has_work
    assert len(cancelled) > 100 and set(run.finished) == {r.seq_id for r in requests} - cancelled
    assert cancelled & set(run.first_step) and cancelled - set(run.first_step)  # running ones and waiting ones
    assert run.preempted()
    assert_reference(run, [r for r in requests if r.seq_id not in cancelled])


def workload_digest(count: int) -> str:
    """A digest of every step of a seeded random workload (unseeded requests included)."""
    scheduler = Scheduler(random_config(), seed=3)
    before, _, _ = random_workload(scheduler, random.Random(4), count)
    run = drive(scheduler, before, pinned=frozenset({"p", "q"}))
    return hashlib.sha256(repr(run.steps).encode()).hexdigest()


def test_the_same_submissions_give_the_same_steps_under_any_hash_seed() -> None:
    here = workload_digest(150)
    assert workload_digest(150) == here
    code = f"from tests.serving.test_scheduler import workload_digest; print(workload_digest({150}))"
    env = os.environ | {"PYTHONHASHSEED": "12345"}
    there = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True)
    assert there.stdout.strip() == here
