"""An HTTP client of one vLLM OpenAI server: its runtime LoRA endpoints, its model list, its
version and its streamed completions (token ids in, token ids out).

One connection per call (`http.client`): calls from many threads never share a socket, and a
server that restarted between two calls is simply reached again.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

from node_agent.backend import Sampling
from node_agent.backends.server import CompletionStep, Refusal, ServerModels, ServerRequests, StreamBroken, TopLogprobs
from node_agent.backends.vllm.refusals import classify, unreachable
from node_agent.backends.vllm.server_metrics import parse_requests

#: How long a control call (a load reads and checks the adapter) may take.
CONTROL_TIMEOUT_S = 120.0
#: Model listings and versions: a server that takes longer counts as not answering.
LOOK_TIMEOUT_S = 5.0
#: The server's metrics, read for every statistics call: a slow answer leaves the server out.
METRICS_TIMEOUT_S = 2.0
#: Between two streamed tokens.
STREAM_TIMEOUT_S = 300.0
#: How vLLM names a token in logprobs with `return_tokens_as_token_ids`.
TOKEN_ID_PREFIX = "token_id:"


class VllmServer:
    """One vLLM OpenAI server at `url` ("http://host:port"); safe to call from many threads."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or parts.path.strip("/"):
            raise ValueError(f"a vLLM endpoint is http://HOST:PORT, not {url!r}")
        self._url = url.rstrip("/")
        self._host = parts.hostname
        self._port = parts.port or 80

    @property
    def url(self) -> str:
        return self._url

    def load(self, name: str, path: str) -> Refusal | None:
        """`POST /v1/load_lora_adapter` with `load_inplace`: a version of `name` the server
        holds is replaced in place (requests naming it keep working throughout)."""
        return self._control("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, "load_inplace": True})

    def unload(self, name: str) -> Refusal | None:
        """`POST /v1/unload_lora_adapter`."""
        return self._control("/v1/unload_lora_adapter", {"lora_name": name})

    def models(self) -> ServerModels | Refusal:
        """`GET /v1/models`: the base model and the adapters held (listed with it as `parent`)."""
        try:
            status, body = self._request("GET", "/v1/models", None, LOOK_TIMEOUT_S)
        except OSError as error:
            return unreachable(error)
        if status != 200:
            return classify(status, body)
        return _parse_models(body)

    def version(self) -> str:
        """`GET /version`."""
        try:
            status, body = self._request("GET", "/version", None, LOOK_TIMEOUT_S)
            if status == 200:
                return f"vllm {json.loads(body)['version']}"
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return "vllm, version unknown"

    def requests(self) -> ServerRequests | Refusal:
        """`GET /metrics`: the requests every client sent the server that run and wait now."""
        try:
            status, body = self._request("GET", "/metrics", None, METRICS_TIMEOUT_S)
        except OSError as error:
            return unreachable(error)
        if status != 200:
            return classify(status, body)
        return parse_requests(body.decode("utf-8", errors="replace"))

    def complete(self, model: str, tokens: Sequence[int], sampling: Sampling) -> Iterator[CompletionStep] | Refusal:
        """`POST /v1/completions`, streamed, with the token ids as the prompt."""
        connection = http.client.HTTPConnection(self._host, self._port, timeout=STREAM_TIMEOUT_S)
        try:
            body = json.dumps(completion_request(model, tokens, sampling))
            connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
        except OSError as error:
            connection.close()
            return unreachable(error)
        if response.status != 200:
            refusal = classify(response.status, response.read())
            connection.close()
            return refusal
        return _steps(connection, response)

    def _control(self, path: str, payload: dict[str, Any]) -> Refusal | None:
        try:
            status, body = self._request("POST", path, payload, CONTROL_TIMEOUT_S)
        except OSError as error:
            return unreachable(error)
        return None if status == 200 else classify(status, body)

    def _request(self, method: str, path: str, payload: dict[str, Any] | None, timeout: float) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
        try:
            body = None if payload is None else json.dumps(payload)
            headers = {} if payload is None else {"Content-Type": "application/json"}
            connection.request(method, path, body, headers)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()


def completion_request(model: str, tokens: Sequence[int], sampling: Sampling) -> dict[str, Any]:
    """vLLM's `/v1/completions` body for a token-id prompt, asking for token ids back."""
    request: dict[str, Any] = {
        "model": model,
        "prompt": list(tokens),
        "stream": True,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "min_p": sampling.min_p,
        "stop_token_ids": list(sampling.stop_token_ids),
    }
    if sampling.top_k > 0:  # the seam's 0 is "off"; vLLM's off is its default
        request["top_k"] = sampling.top_k
    if sampling.seed is not None:
        request["seed"] = sampling.seed
    if sampling.logprobs is not None:
        request["logprobs"] = sampling.logprobs
    return request


def _parse_models(body: bytes) -> ServerModels | Refusal:
    """The base model's id (the entry without a parent) and each adapter's id and path."""
    try:
        entries = json.loads(body)["data"]
        base = next(str(entry["id"]) for entry in entries if entry.get("parent") is None)
        adapters = tuple((str(entry["id"]), str(entry.get("root") or "")) for entry in entries if entry.get("parent") == base)
    except (ValueError, KeyError, TypeError, StopIteration):
        return Refusal(200, "UnexpectedAnswer", f"/v1/models answered {body[:200]!r}", permanent=False)
    return ServerModels(base, adapters)


def _steps(connection: http.client.HTTPConnection, response: http.client.HTTPResponse) -> Iterator[CompletionStep]:
    """Each token of a streamed completion's server-sent events, until `[DONE]`."""
    try:
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[len(b"data:") :].strip()
            if data == b"[DONE]":
                return
            yield from _event_steps(json.loads(data))
    finally:
        connection.close()


def _event_steps(event: dict[str, Any]) -> Iterator[CompletionStep]:
    """The tokens one event carries (usually one); the last gets the event's finish reason."""
    if "error" in event:
        error = event["error"]
        raise StreamBroken(classify(int(error.get("code") or 500), json.dumps(event).encode()))
    choice = event["choices"][0]
    ids = [int(token) for token in choice.get("token_ids") or ()]
    logprobs = _logprobs(choice.get("logprobs"), len(ids))
    finish = str(choice.get("finish_reason") or "")
    for index, token in enumerate(ids):
        yield CompletionStep(token, logprobs[index], finish if index == len(ids) - 1 else "")


def _logprobs(logprobs: dict[str, Any] | None, count: int) -> list[TopLogprobs | None]:
    """Each token's logprobs from an event's `logprobs` (None each when not asked for)."""
    if not logprobs:
        return [None] * count
    steps: list[TopLogprobs | None] = []
    for logprob, top in zip(logprobs["token_logprobs"], logprobs.get("top_logprobs") or [{}] * count, strict=True):
        ranked = sorted((top or {}).items(), key=lambda item: -item[1])
        steps.append(
            TopLogprobs(
                float(logprob),
                tuple(int(token.removeprefix(TOKEN_ID_PREFIX)) for token, _ in ranked),
                tuple(float(value) for _, value in ranked),
            )
        )
    return steps
