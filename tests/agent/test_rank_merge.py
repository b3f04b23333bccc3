"""Merging every rank's control reply into one result (`merge_control`), and a rolled-back load.

The failure-first rule itself is tested in tests/test_merge.py; here: which rank's holdings the
result reports, that every rank's reply is kept, and how a rollback is reported.
"""

from __future__ import annotations

from node_agent.backend import ControlReply, merge_control, rolled_back


def reply(rank: int, ok: bool, error: str = "", holds: tuple[str, ...] = (), transient: bool = False) -> ControlReply:
    return ControlReply(rank, rank // 2, rank % 2, ok, error, transient=transient, holds=holds)


def test_success_only_when_every_rank_succeeded_then_the_first_ranks_holdings():
    result = merge_control([reply(0, True, holds=("a", "b")), reply(1, True, holds=("b", "a"))])
    assert result.ok and result.error == "" and result.holds == ("a", "b") and len(result.ranks) == 2
    assert not result.already_loaded


def test_failure_joins_the_ranks_messages_and_takes_the_first_failed_ranks_holdings():
    result = merge_control(
        [
            reply(0, True, holds=("a",)),
            reply(1, False, "disk full", ("b",)),
            reply(2, False, "bad shape", ("c",)),
            reply(3, False, "disk full", ("d",)),
        ]
    )
    assert not result.ok
    assert result.error == "disk full | bad shape"
    assert result.holds == ("b",)


def test_rolled_back_ranks_are_reported_as_not_holding_the_adapter_and_the_error_is_kept():
    loaded = merge_control([reply(0, True, holds=("x",)), reply(1, False, "injected"), reply(2, True, holds=("x",))])
    after = [reply(0, True), reply(1, False, "'x' is not loaded"), reply(2, True)]
    result = rolled_back(loaded, after)
    assert result.error == "injected"
    assert [(r.rank, r.ok) for r in result.ranks] == [(0, False), (1, False), (2, False)]
    assert result.ranks[0].error == result.ranks[2].error == "loaded, then rolled back because the load failed on rank 1"
    assert result.ranks[1].error == "injected"
    assert [r.holds for r in result.ranks] == [(), (), ()], "what each rank holds after the rollback"


def test_a_failure_is_transient_only_when_no_failed_rank_refused():
    """A rank that could not act now (its server down) makes a transient failure; one refusal
    beside it makes the whole failure permanent, and a success is never transient."""
    down = reply(1, False, "server 1 unreachable", transient=True)
    assert merge_control([reply(0, True), down]).transient
    assert merge_control([down, reply(2, False, "unreachable too", transient=True)]).transient
    assert not merge_control([down, reply(2, False, "bad shape")]).transient
    assert not merge_control([reply(0, True), reply(1, True, transient=True)]).transient


def test_a_rolled_back_transient_load_stays_transient():
    loaded = merge_control([reply(0, True, holds=("x",)), reply(1, False, "server 1 unreachable", transient=True)])
    result = rolled_back(loaded, [reply(0, True), reply(1, False, "'x' is not loaded")])
    assert result.transient and [r.ok for r in result.ranks] == [False, False]
