"""A request's body as JSON, or a 400 `invalid_json` that says what is wrong with it.

Past JSON's syntax, `json.loads` has limits of its own that a client can reach: the body must be
text (JSON is UTF-8: RFC 8259) and so must its strings be (an escaped UTF-16 surrogate without
its pair is no character: the tokenizer cannot take it), nesting recurses (refused here before
parsing, under the engine's bound for JSON it reads, `MAX_JSON_DEPTH`), and an integer is
Python's, whose digits are limited (`sys.get_int_max_str_digits`). Each is the client's error,
named as such.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from typing import Any

from aiohttp import web

from node_agent.engine import MAX_JSON_DEPTH, nesting_depth
from node_agent.http_api.connections import read_body
from node_agent.http_api.errors import ApiError

# An escaped UTF-16 surrogate (`\ud83d`): paired, one character (clients that escape everything
# but ASCII send emoji so); alone, none.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


async def read_json(request: web.Request) -> Any:
    """The request's body, parsed (off the event loop: a body may be megabytes)."""
    return await asyncio.to_thread(parse_json, await read_body(request))


def parse_json(body: bytes) -> Any:
    """`body` parsed as JSON; ApiError 400 `invalid_json` naming what is wrong otherwise."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _invalid(f"the request body is not valid UTF-8 (byte {error.start}: {error.reason})") from None
    if nesting_depth(text) > MAX_JSON_DEPTH:
        raise _invalid(f"the request body nests deeper than {MAX_JSON_DEPTH} arrays and objects")
    try:
        value = json.loads(text, parse_int=_integer)
    except json.JSONDecodeError as error:
        raise _invalid(f"the request body is not valid JSON: {error}") from None
    if _SURROGATE_ESCAPE.search(text) and not _is_unicode(value):
        raise _invalid("a string in the request body has an unpaired surrogate escape (\\ud800-\\udfff): it is no Unicode text")
    return value


def _integer(digits: str) -> int:
    """An integer of the body; `int` refuses one past Python's digit limit (the only way a JSON
    integer's literal fails it)."""
    try:
        return int(digits)
    except ValueError:
        raise _invalid(f"an integer in the request body has more than {sys.get_int_max_str_digits()} digits") from None


def _is_unicode(value: Any) -> bool:
    """Whether every string of a parsed body (keys included) is Unicode text."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _invalid(message: str) -> ApiError:
    return ApiError(400, message, None, "invalid_json")
