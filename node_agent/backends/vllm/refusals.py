"""What a vLLM server's refusal means: permanent (asking again gets the same answer) or transient
(the server is starting, restarting, overloaded or unreachable: asking later may succeed).

vLLM answers a failed request with `{"error": {"message", "type", "code"}}` (its
`ErrorResponse`) and an HTTP status; the classification reads the status, and for a 500 (which
`/v1/load_lora_adapter` answers for anything the engine raised while loading) the message.
"""

from __future__ import annotations

import json

from node_agent.backends.server import Refusal

#: Statuses that say "not now": asking again later may succeed.
TRANSIENT_STATUSES = frozenset({408, 425, 429, 502, 503, 504})
#: A 500 that names these is the engine going away, not the request: transient.
ENGINE_GONE_MARKERS = ("EngineCore encountered an issue", "EngineDeadError", "Engine loop is not running")


def classify(status: int, body: bytes) -> Refusal:
    """The refusal a server's non-2xx answer (`status`, its body) is."""
    error_type, message = _error_fields(body)
    if not error_type:
        error_type = "HTTPError"
    if status in TRANSIENT_STATUSES:
        permanent = False
    elif status >= 500:
        # vLLM answers 500 for an adapter its engine could not load (a ValueError about ranks or
        # modules): permanent; a dead engine core is the server's state, not the request's.
        permanent = status == 500 and not any(marker in message for marker in ENGINE_GONE_MARKERS)
    else:
        permanent = True
    return Refusal(status, error_type, message, permanent)


def unreachable(error: OSError) -> Refusal:
    """The server did not answer at all (refused connection, reset, timeout): transient."""
    return Refusal(0, "Unreachable", str(error) or type(error).__name__, permanent=False)


def _error_fields(body: bytes) -> tuple[str, str]:
    """vLLM's error type and message from a body, or ("", the body as text) if it is not vLLM's."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        parsed = json.loads(text)
    except ValueError:
        return "", text[:500]
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict):
        return str(error.get("type") or ""), str(error.get("message") or "")[:2000]
    if isinstance(parsed, dict) and "detail" in parsed:  # FastAPI's own 4xx (a malformed request)
        return "RequestValidationError", str(parsed["detail"])[:2000]
    return "", text[:500]
