"""Stop strings (node_agent.text.StopStrings): OpenAI semantics on any split of the text into
pieces — the text ends before the first stop string, and no piece ever carries text that turns
out to belong to a stop string."""

from __future__ import annotations

import itertools

import pytest

from node_agent.text import MAX_STOP_STRINGS, StopStrings


def run(pieces: list[str], stops: list[str]) -> tuple[list[str], str | None]:
    """Push every piece (flushing at the end as a finished generation does): the emitted pieces."""
    matcher = StopStrings(stops)
    out = []
    for piece in pieces:
        out.append(matcher.push(piece))
        if matcher.matched is not None:
            return out, matcher.matched
    out.append(matcher.flush())
    return out, None


def splits(text: str) -> list[list[str]]:
    """Every way of cutting `text` into pieces (each a possible stream of token texts)."""
    result = []
    for cuts in itertools.product((False, True), repeat=len(text) - 1):
        pieces, start = [], 0
        for i, cut in enumerate(cuts, start=1):
            if cut:
                pieces.append(text[start:i])
                start = i
        pieces.append(text[start:])
        result.append(pieces)
    return result


@pytest.mark.parametrize(
    ("text", "stops", "expected", "matched"),
    [
        ("hi there. bye", ["."], "hi there", "."),
        ("abcabd", ["abd"], "abc", "abd"),  # a partial match ("ab") that fails, then a real one
        ("aaab", ["aab"], "a", "aab"),  # the match starts inside a held-back run
        ("one END two", ["END", "two"], "one ", "END"),  # the earliest stop string wins
        ("x STOP", ["STOP", "OP"], "x ", "STOP"),  # earliest start, not earliest end
        ("no stop here", ["zz"], "no stop here", None),
        ("end: st", ["stop"], "end: st", None),  # held back, then flushed at the end
    ],
)
def test_every_split_gives_the_text_before_the_first_stop_string(text, stops, expected, matched):
    for pieces in splits(text):
        out, hit = run(pieces, stops)
        assert ("".join(out), hit) == (expected, matched), pieces
        emitted = ""
        for piece in out:
            emitted += piece
            assert expected.startswith(emitted), f"{pieces}: emitted {emitted!r}, which is not a prefix of {expected!r}"


def test_text_that_may_begin_a_stop_string_is_held_back_until_known():
    matcher = StopStrings(["</end>"])
    assert matcher.push("answer </e") == "answer "
    assert matcher.push("nd") == ""
    assert matcher.push("x") == "</endx"
    assert matcher.push(" more </end> never") == " more "
    assert matcher.matched == "</end>"
    assert matcher.push("after") == "" and matcher.flush() == ""


@pytest.mark.parametrize(
    ("stops", "message"),
    [
        ([""], "must not be empty"),
        (["x" * 257], "at most 256 characters"),
        (["s"] * (MAX_STOP_STRINGS + 1), f"at most {MAX_STOP_STRINGS} stop strings"),
    ],
)
def test_bad_stop_strings_are_refused_naming_the_field(stops, message):
    with pytest.raises(ValueError, match=message) as error:
        StopStrings(stops)
    assert str(error.value).startswith("stop:")
