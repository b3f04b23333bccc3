"""The failure-first merge on its own."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from lorafleet_common.merge import NO_MESSAGE, merge_failure_first


@dataclass
class Reply:
    ok: bool
    error: str | None = ""
    loaded: tuple[str, ...] = ()


def merge(replies):
    return merge_failure_first(replies, lambda r: r.ok, lambda r: r.error)


def test_all_succeeded_returns_the_first_reply_object_itself():
    replies = [Reply(True, loaded=("a",)), Reply(True, loaded=("b",))]
    merged = merge(replies)
    assert merged.ok and merged.error == "" and merged.reply is replies[0]


def test_any_failure_fails_with_distinct_messages_in_order_of_first_appearance():
    replies = [Reply(True), Reply(False, "disk full", ("x",)), Reply(False, "bad shape", ("y",)), Reply(False, "disk full")]
    merged = merge(replies)
    assert not merged.ok
    assert merged.error == "disk full | bad shape"
    assert merged.reply is replies[1], "the first failed reply stands for the whole (its loaded list)"


def test_a_failure_without_a_message_does_not_crash_the_merge():
    merged = merge([Reply(True), Reply(False, None), Reply(False, "")])
    assert not merged.ok and merged.error == NO_MESSAGE


def test_nothing_to_merge_is_an_error():
    with pytest.raises(ValueError):
        merge([])
