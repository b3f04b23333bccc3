"""The one place requests are checked, at the agent's boundary: adapter names, token ids against
the vocabulary, request sizes.

The engine trusts what passes here and checks only its own state (which adapters are loaded).
Everything that drives the engine checks through these functions first: the agent for every
RPC, `lorafleet-agent forward` for its command line and input file.
"""

from __future__ import annotations

from collections.abc import Sequence

from lorafleet_common.adapter_names import ADAPTER_NAME, MAX_NAME_LENGTH, is_adapter_name
from node_agent.errors import InvalidRequest

# ADAPTER_NAME is the shared rule (lorafleet_common.adapter_names), re-exported for the agent's readers.
__all__ = ["ADAPTER_NAME", "check_adapter_name", "check_forward", "check_generate"]


def check_adapter_name(name: str) -> None:
    """Refuse a name outside the shared adapter-name rule (`ADAPTER_NAME`) with `InvalidRequest`."""
    if not is_adapter_name(name or ""):
        raise InvalidRequest(f"invalid adapter name {name!r} (letters, digits, '.', '_', '-'; at most {MAX_NAME_LENGTH} characters)")


def check_forward(sequences: Sequence[Sequence[object]], vocab_size: int, max_tokens: int | None = None) -> None:
    """A Forward batch: at least one sequence, each non-empty, every id inside the vocabulary,
    at most `max_tokens` tokens in all (None: no limit)."""
    if not sequences:
        raise InvalidRequest("a forward needs at least one sequence")
    _check_tokens(sequences, "sequence", vocab_size, max_tokens)


def check_generate(prompt: Sequence[object], max_new_tokens: int, limit: int, vocab_size: int, max_tokens: int) -> None:
    """A Generate: 1 <= `max_new_tokens` <= `limit`, a non-empty prompt inside the vocabulary,
    and the prompt with every new token within `max_tokens`."""
    if not 1 <= max_new_tokens <= limit:
        raise InvalidRequest(f"max_new_tokens must be within [1, {limit}], got {max_new_tokens}")
    _check_tokens([prompt], "prompt", vocab_size, max_tokens, extra=max_new_tokens)


def _check_tokens(batches: Sequence[Sequence[object]], what: str, vocab_size: int, max_tokens: int | None, extra: int = 0) -> None:
    for index, tokens in enumerate(batches):
        if not tokens:
            raise InvalidRequest(f"{what} {index} has no tokens")
        # Ids from JSON (the forward command) may be anything; bool is an int to Python.
        bad = [t for t in tokens if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(f"{what} {index} has token id {bad[0]!r} outside the vocabulary [0, {vocab_size})")
    total = sum(len(tokens) for tokens in batches) + extra
    if max_tokens is not None and total > max_tokens:
        raise InvalidRequest(f"the request needs {total} tokens, over the limit of {max_tokens}")
