"""PEFT's module-name patterns, compiled for RE2 (linear-time matching) and matched as PEFT
matches them: `target_modules` / `exclude_modules` (names or one pattern), `layers_pattern`, and
`rank_pattern` / `alpha_pattern` keys."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any, Protocol

import re2

from node_agent.engine.adapters.errors import CONFIG_FILE, AdapterLoadError, shorten

# Where PEFT reads a module's layer index without `layers_pattern`: the first numbered segment.
_FIRST_INDEX = re.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.", re.ASCII)


class Match(Protocol):
    """A match of a `Regex`."""

    def group(self, name: str, /) -> str | Any: ...


class Regex(Protocol):
    """A compiled RE2 pattern (google-re2 ships no type information)."""

    pattern: str

    def match(self, text: str) -> Match | None: ...

    def fullmatch(self, text: str) -> object | None: ...


@dataclass(frozen=True)
class ModulePattern:
    """One `rank_pattern` / `alpha_pattern` entry: PEFT's key, compiled for RE2, and its value."""

    key: str
    regex: Regex
    value: float


def selects(names: tuple[str, ...] | None, regex: Regex | None, module_name: str) -> bool:
    """PEFT's rule for a list of names (exact, or a dotted suffix) or a pattern (full match)."""
    if regex is not None:
        return regex.fullmatch(module_name) is not None
    return names is not None and (module_name in names or any(module_name.endswith(f".{n}") for n in names))


def layer_index(module_name: str, patterns: tuple[Regex, ...]) -> int | None:
    """The layer index PEFT reads from a module name: after the first pattern that matches, or
    the first numbered segment without patterns."""
    for pattern in patterns or (_FIRST_INDEX,):
        match = pattern.match(module_name)
        if match is not None:
            return int(match.group("idx"))
    return None


def pattern_value(patterns: tuple[ModulePattern, ...], module_name: str) -> float | None:
    # PEFT's rule (get_pattern_key): the first key, in the config's order, whose
    # `(.*\.)?(key)$` matches the module name from its start wins.
    for pattern in patterns:
        if pattern.regex.match(module_name) is not None:
            return pattern.value
    return None


_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a refused pattern is reported in the AdapterLoadError, not on stderr
# Both engines accept these, with different meanings: Python reads `{,n}` as a repetition and
# `[[:digit:]]` as a set of characters, RE2 as a literal and as a POSIX class.
_AMBIGUOUS = re.compile(r"\{,\d*\}|\[:")


def compile_pattern(field: str, key: str, pattern: str) -> Regex:
    """`pattern` (PEFT's form of `key`) for RE2, refused unless Python's re, PEFT's engine, reads it alike."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Possible nested set": `[:` is refused below anyway
            re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as error:
        raise AdapterLoadError(
            f"{CONFIG_FILE}: {field} {shorten(repr(key), 120)} is not a valid regular expression ({shorten(str(error), 120)})"
        ) from None
    if _AMBIGUOUS.search(key):
        raise AdapterLoadError(
            f"{CONFIG_FILE}: {field} {shorten(repr(key), 120)} is refused: `{{,n}}` and `[:` mean different things "
            "in Python's re and in RE2, the engine's linear-time matcher"
        )
    try:
        regex: Regex = re2.compile(pattern, options=_RE2_OPTIONS)
    except re2.error as error:
        reason = error.args[0].decode(errors="replace") if error.args and isinstance(error.args[0], bytes) else str(error)
        raise AdapterLoadError(
            f"{CONFIG_FILE}: {field} {shorten(repr(key), 120)} is not supported by RE2, the engine's linear-time "
            f"matcher (no backreferences, lookaround, possessive or atomic groups): {shorten(reason, 120)}"
        ) from None
    return regex
