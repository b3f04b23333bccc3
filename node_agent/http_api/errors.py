"""Errors of the HTTP API in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`.

`HTTP_STATUSES` is the one place where the agent's domain errors become HTTP statuses (as
`server.STATUS_CODES` is for gRPC): bad input 400, an unknown model 404 (`model_not_found`),
over capacity 429 (a budget or the engine's queue is full: retry later) or 503 (the engine
cannot take it now), as vLLM answers; anything unexpected 500, whose answer names neither the
exception nor its text (internals are not the client's): a reference the log gives the cause under.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from node_agent.errors import (
    AdapterNotFound,
    AgentError,
    CapacityExceeded,
    EngineUnavailable,
    InvalidRequest,
    NotSupported,
    RequestAborted,
    ShuttingDown,
    TooManyCalls,
)

log = logging.getLogger(__name__)

HTTP_STATUSES: dict[type[AgentError], int] = {
    InvalidRequest: 400,
    AdapterNotFound: 404,
    TooManyCalls: 429,
    CapacityExceeded: 503,
    ShuttingDown: 503,
    EngineUnavailable: 503,
    RequestAborted: 503,
    NotSupported: 501,
}

# OpenAI's error types by status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    500: "internal_error",
}

# The agent's messages name its own fields; the HTTP API's caller knows OpenAI's names.
_PARAMS = {
    "max_new_tokens": "max_tokens",
    "stop": "stop",
    "SamplingParams.temperature": "temperature",
    "SamplingParams.top_p": "top_p",
    "SamplingParams.top_k": "top_k",
    "SamplingParams.min_p": "min_p",
    "SamplingParams.seed": "seed",
    "SamplingParams.logprobs": "logprobs",
}


@dataclass
class ApiError(Exception):
    """One refusal, ready to send: its status and the fields of OpenAI's error object."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "internal_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def from_agent_error(error: AgentError, prompt_param: str) -> ApiError:
    """The HTTP refusal of an agent's error; `prompt_param` names where the prompt came from
    ("prompt" or "messages") for errors about its tokens."""
    status = HTTP_STATUSES.get(type(error), 500)
    param = None
    if status == 400:
        message = str(error)
        param = next((name for field, name in _PARAMS.items() if message.startswith(field)), prompt_param)
    return ApiError(status, str(error), param, error.reason)


def internal_error(error: BaseException, doing: str) -> ApiError:
    """500 for a bug met while `doing` (e.g. "answering POST /v1/completions"): logged with its
    traceback under a reference, which is all the answer says of it."""
    reference = secrets.token_hex(6)
    log.error("unexpected error %s (reference %s)", doing, reference, exc_info=error)
    return ApiError(500, f"internal error: the agent's log has the cause under reference {reference}", None, "internal")


def model_not_found(model: str, error: AgentError) -> ApiError:
    """404 for a `model` that is neither the base model nor a routable adapter."""
    return ApiError(404, f"The model {model!r} does not exist on this agent ({error})", "model", "model_not_found")


def from_validation_error(error: ValidationError) -> ApiError:
    """400 naming the first refused parameter (its location, dotted: `messages.0.content`)."""
    first = error.errors(include_url=False)[0]
    param = _location(first["loc"])
    message = re.sub(r"^Value error, ", "", first["msg"])
    return ApiError(400, f"{param}: {message}" if param else message, param or None, "invalid_value")


_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _location(loc: Sequence[int | str]) -> str:
    # Union members show up as extra steps ("str", "constrained-str", "list[int]", ...): keep
    # only field names and list indices (the schema's field names are plain identifiers).
    parts = [str(step) for step in loc if isinstance(step, int) or (_FIELD.match(step) and step not in _TYPE_TAGS)]
    return ".".join(parts)
