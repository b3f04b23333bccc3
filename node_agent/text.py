"""Text for Generate: the model directory's tokenizer (if any), its end-of-sequence ids,
incremental decoding and stop strings.

Text is optional: with a `tokenizer.json` in the model directory (the Hugging Face `tokenizers`
format) Generate accepts a text prompt and streams each token's text; without one it works on
token ids only. The `tokenizers` package is imported only when a tokenizer file exists. Stop
strings (`StopStrings`) are matched here once, for gRPC Generate and the HTTP API alike.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
REPLACEMENT_CHAR = "\ufffd"


def load_tokenizer(model_dir: Path) -> Any | None:
    """The model's `tokenizers.Tokenizer`, or None when the directory has no tokenizer.json."""
    path = Path(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """End-of-sequence ids from generation_config.json, else config.json; () when neither says."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(value, int):
            return (value,)
        if isinstance(value, list) and all(isinstance(v, int) for v in value):
            return tuple(value)
    return ()


class IncrementalDecoder:
    """Turns generated ids into text pieces whose concatenation is the decoded whole.

    Decoding one id at a time breaks multi-byte characters and word-boundary spaces, so the
    whole generated sequence is decoded each time and the new suffix emitted; a suffix ending
    in an incomplete character (U+FFFD) is held back until the next token completes it.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._emitted = ""

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text: str = self._tokenizer.decode(self._ids)
        if text.endswith(REPLACEMENT_CHAR) or not text.startswith(self._emitted):
            return ""  # incomplete character, or a decoder that rewrote earlier text: wait
        piece = text[len(self._emitted) :]
        self._emitted = text
        return piece


MAX_STOP_STRINGS = 16  # as many as a request may give (OpenAI allows 4; vLLM has no limit)
MAX_STOP_LENGTH = 256  # characters in one stop string


class StopStrings:
    """Ends generated text at the first stop string, with OpenAI semantics: the stop string and
    everything after it are never emitted, and a piece that could be the start of a stop string
    is held back until the following text shows whether it is one.

    `push` takes each new piece of decoded text and returns what may be emitted now; once a stop
    string is found, `matched` names it and `push` returns only the text before it. At the end of
    a generation that matched nothing, `flush` returns what was held back.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        for stop in stops:
            if not stop:
                raise ValueError("stop: a stop string must not be empty")
            if len(stop) > MAX_STOP_LENGTH:
                raise ValueError(f"stop: a stop string has at most {MAX_STOP_LENGTH} characters, got {len(stop)}")
        self._stops = tuple(dict.fromkeys(stops))
        self._text = ""
        self._emitted = 0  # characters of `_text` already returned
        self.matched: str | None = None

    def push(self, piece: str) -> str:
        """The text that may be emitted after `piece` (nothing once a stop string matched)."""
        if self.matched is not None:
            return ""
        self._text += piece
        # No earlier match exists, and text that could start one was never emitted: a match can
        # only start at or after `_emitted`.
        hits = [(position, stop) for stop in self._stops if (position := self._text.find(stop, self._emitted)) >= 0]
        if hits:
            position, self.matched = min(hits)
            return self._take(position)
        return self._take(len(self._text) - self._held_back())

    def flush(self) -> str:
        """What was held back (the generation ended without a match)."""
        return "" if self.matched is not None else self._take(len(self._text))

    def _held_back(self) -> int:
        """The length of the longest end of the text that begins some stop string."""
        text = self._text
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text) - self._emitted), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def _take(self, end: int) -> str:
        piece = self._text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return piece
