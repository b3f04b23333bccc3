"""Text for Generate: the model directory's tokenizer (if any) and its end-of-sequence ids.

Text is optional: with a `tokenizer.json` in the model directory (the Hugging Face `tokenizers`
format) Generate accepts a text prompt and streams each token's text; without one it works on
token ids only. The `tokenizers` package is imported only when a tokenizer file exists.
"""

from __future__ import annotations

import json
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
