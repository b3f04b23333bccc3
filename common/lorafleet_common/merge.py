"""Failure-first merging: the one rule for combining replies from many parts.

Used at every level: rank replies into an engine/agent reply, agent replies into a resource's
status. Success only when every part succeeded, and then the merged reply is the first part's
reply itself; otherwise the distinct error messages, in order of first appearance, joined
with " | ", and the first failed part stands for the whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

SEPARATOR = " | "
NO_MESSAGE = "failed without an error message"


@dataclass(frozen=True)
class Merged(Generic[T]):
    ok: bool
    reply: T  # the first reply on success, the first failed reply otherwise
    error: str  # "" on success


def merge_failure_first(replies: Sequence[T], ok: Callable[[T], bool], error: Callable[[T], str | None]) -> Merged[T]:
    """Merge replies failure-first; `ok` and `error` read a reply's outcome and message."""
    if not replies:
        raise ValueError("nothing to merge: no replies")
    failed = [r for r in replies if not ok(r)]
    if not failed:
        return Merged(True, replies[0], "")
    messages = [error(r) or NO_MESSAGE for r in failed]
    return Merged(False, failed[0], SEPARATOR.join(dict.fromkeys(messages)))
