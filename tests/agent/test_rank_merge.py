"""Merging per-rank outcomes of a control call (the failure-first rule, at the agent level)."""

from __future__ import annotations

from lorafleet_common.merge import NO_MESSAGE
from node_agent.agent import RankOutcome, merge_rank_outcomes, rolled_back


def outcome(rank: int, ok: bool, error: str = "", loaded: tuple[str, ...] = ()) -> RankOutcome:
    return RankOutcome(rank, rank // 2, rank % 2, ok, error, loaded)


def test_success_only_when_every_rank_succeeded_then_the_first_ranks_loaded_list():
    result = merge_rank_outcomes([outcome(0, True, loaded=("a", "b")), outcome(1, True, loaded=("b", "a"))])
    assert result.ok and result.error == "" and result.loaded == ("a", "b") and len(result.ranks) == 2


def test_failure_joins_distinct_messages_in_order_and_takes_the_first_failed_ranks_loaded_list():
    result = merge_rank_outcomes([
        outcome(0, True, loaded=("a",)),
        outcome(1, False, "disk full", ("b",)),
        outcome(2, False, "bad shape", ("c",)),
        outcome(3, False, "disk full", ("d",)),
    ])
    assert not result.ok
    assert result.error == "disk full | bad shape"
    assert result.loaded == ("b",)


def test_a_failure_without_a_message_does_not_crash():
    result = merge_rank_outcomes([outcome(0, False), outcome(1, False, "")])
    assert not result.ok and result.error == NO_MESSAGE


def test_rolled_back_ranks_are_reported_as_not_holding_the_adapter_and_the_error_is_kept():
    result = rolled_back(merge_rank_outcomes([outcome(0, True), outcome(1, False, "injected"), outcome(2, True)]))
    assert result.error == "injected"
    assert [(o.rank, o.ok) for o in result.ranks] == [(0, False), (1, False), (2, False)]
    assert result.ranks[0].error == result.ranks[2].error == "loaded, then rolled back because the load failed on rank 1"
    assert result.ranks[1].error == "injected"
