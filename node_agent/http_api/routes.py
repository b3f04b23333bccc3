"""The HTTP API's routes over one agent: auth, health, metrics, models and generation.

Inference takes a place of the same inference budget as gRPC's Forward and Generate
(`--max-inference-calls`), so the limit holds whichever API calls arrive on; a request beyond it
waits in the budget's queue without blocking the event loop, and one beyond the queue or its wait
is refused with 429. Nothing here waits for a control call: `/v1/models` reads the
agent's registry (an in-process table), `/health` the engine's process states, and generation
goes to the engine's scheduler.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from node_agent.agent import Agent
from node_agent.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from node_agent.errors import AdapterNotFound, AgentError, ShuttingDown
from node_agent.http_api.errors import ApiError, from_agent_error, from_validation_error, internal_error, model_not_found
from node_agent.http_api.json_body import read_json
from node_agent.http_api.responses import Kind, Reply
from node_agent.http_api.schema import DEFAULT_COMPLETION_TOKENS, ChatCompletionRequest, CompletionRequest
from node_agent.http_api.streams import Choices, Event
from node_agent.values import GenerateParams

OPEN_PATHS = ("/health", "/metrics")  # probes and scrapers send no token (as on gRPC and the metrics port)
MAX_BODY_BYTES = 16 << 20
SEED_LIMIT = 2**64


class Budget(Protocol):
    """A class of calls with a limit and a queue (the gRPC server's `CallBudget`): `acquire_async`
    waits in the queue without blocking the event loop, or refuses."""

    async def acquire_async(self) -> None: ...

    def release(self) -> None: ...


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Generation:
    """One completion or chat request, ready to run: its choices' parameters and how to answer."""

    kind: Kind
    body: CompletionRequest | ChatCompletionRequest
    params: list[GenerateParams]  # every choice's parameters, prompt by prompt
    prompts: int  # how many prompts the choices are spread over (`n` choices each)
    prompt_param: str  # the request parameter a refusal of the prompt names
    logprobs: bool  # whether the answer carries logprobs


class ApiRoutes:
    """The routes over one agent."""

    def __init__(self, agent: Agent, token: str | None, budget: Budget | None, closing: threading.Event) -> None:
        self.agent = agent
        self._expected = f"Bearer {token}".encode() if token else None
        self._budget = budget
        self._closing = closing
        self._template: ChatTemplate | None = None
        self._template_error: str | None = None
        try:
            self._template = load_chat_template(agent.model_dir)
        except ChatTemplateError as error:  # reported to each chat request, not fatal to the agent
            self._template_error = str(error)

    def app(self, outermost: Middleware) -> web.Application:
        """The routes, under `outermost` (the connections' bookkeeping), then errors and auth."""
        app = web.Application(middlewares=[outermost, self._errors, self._auth], client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        return app

    # -- middlewares -----------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every refusal in OpenAI's error shape, aiohttp's own (404, 405, 413) included."""
        try:
            return await handler(request)
        except ApiError as error:
            return _error_response(error)
        except web.HTTPException as error:
            if error.status < 400:
                raise
            return _error_response(ApiError(error.status, f"{request.method} {request.path}: {error.reason}"))
        except ConnectionResetError:
            raise  # the client went away: nobody to answer
        except Exception as error:  # a bug: still an answer in the API's shape (a stream answers in-stream)
            return _error_response(internal_error(error, f"answering {request.method} {request.path}"))

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self._expected is None or request.path in OPEN_PATHS:
            return await handler(request)
        presented = request.headers.get("Authorization")
        if presented is None:
            raise ApiError(401, "missing credentials: send the header 'Authorization: Bearer <token>'", None, "invalid_api_key")
        # Constant-time comparison: response timing must not reveal how much of a guess matched.
        if not hmac.compare_digest(presented.encode(), self._expected):
            raise ApiError(401, "invalid bearer token", None, "invalid_api_key")
        return await handler(request)

    # -- health, metrics, models -----------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """200 while every rank is alive and no engine command hangs; 503 with the reason otherwise."""
        agent = self.agent
        reason = "the agent is shutting down" if self._closing.is_set() else agent.failure() or agent.hang()
        if reason:
            return web.json_response({"status": "not serving", "reason": reason}, status=503)
        return web.json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        body = await asyncio.to_thread(generate_latest, self.agent.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        """The base model and every routable adapter (held by every rank, not being unloaded)."""
        return web.json_response({"object": "list", "data": self._model_cards()})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        card = next((card for card in self._model_cards() if card["id"] == name), None)
        if card is None:
            raise ApiError(404, f"The model {name!r} does not exist on this agent", "model", "model_not_found")
        return web.json_response(card)

    def _model_cards(self) -> list[dict[str, Any]]:
        # `created` is the time of the listing, as vLLM lists its models and LoRA modules.
        created = int(time.time())
        base = self.agent.base_model_name
        cards = [{"id": base, "object": "model", "created": created, "owned_by": "lorafleet", "root": base, "parent": None}]
        cards += [
            {"id": entry.name, "object": "model", "created": created, "owned_by": "lorafleet", "root": entry.source.uri, "parent": base}
            for entry in self.agent.registry.entries()
            if entry.name != base
        ]
        return cards

    # -- generation ------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = _parse(CompletionRequest, await read_json(request))
        prompts = body.prompts()
        if body.max_tokens is not None:
            self._check_max_tokens(body.max_tokens)
        params = []
        for prompt in prompts:
            max_new = body.max_tokens or DEFAULT_COMPLETION_TOKENS
            base = (
                GenerateParams(prompt=prompt, max_new_tokens=max_new)
                if isinstance(prompt, str)
                else GenerateParams(token_ids=tuple(prompt), max_new_tokens=max_new)
            )
            params += self._choices(body, base, body.logprobs)
        job = Generation("completion", body, params, prompts=len(prompts), prompt_param="prompt", logprobs=body.logprobs is not None)
        return await self._generate(request, job)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = _parse(ChatCompletionRequest, await read_json(request))
        token_ids = await asyncio.to_thread(self._chat_prompt, body)  # rendering and encoding: off the loop
        max_new = body.max_new_tokens
        if max_new is not None:
            self._check_max_tokens(max_new, "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
        else:  # as much as fits: the agent's limit, within the request-size limit
            max_new = max(1, min(self.agent.config.max_new_tokens, self.agent.config.max_request_tokens - len(token_ids)))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self._choices(body, GenerateParams(token_ids=tuple(token_ids), max_new_tokens=max_new), logprobs)
        return await self._generate(request, Generation("chat", body, params, prompts=1, prompt_param="messages", logprobs=body.logprobs))

    def _check_max_tokens(self, value: int, param: str = "max_tokens") -> None:
        limit = self.agent.config.max_new_tokens
        if value > limit:
            raise ApiError(400, f"{param} must be at most {limit} (the agent's --max-new-tokens), got {value}", param, "invalid_value")

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        """The rendered chat as token ids (no special tokens added: the template places them)."""
        if self._template is None:
            reason = self._template_error or (
                "the model has no chat template (chat_template in tokenizer_config.json, or chat_template.jinja): "
                "use /v1/completions with a prompt"
            )
            raise ApiError(400, reason, "messages", "chat_template_missing")
        tokenizer = self.agent.tokenizer
        if tokenizer is None:
            raise ApiError(400, "the model has no tokenizer (tokenizer.json): chat needs one", "messages", "no_tokenizer")
        try:
            text = self._template.render([m.for_template() for m in body.messages], body.add_generation_prompt)
        except ChatTemplateError as error:
            raise ApiError(400, str(error), "messages", "chat_template_error") from None
        ids = list(tokenizer.encode(text, add_special_tokens=False).ids)
        if not ids:
            raise ApiError(400, "the rendered messages encode to no tokens", "messages", "invalid_value")
        return ids

    def _choices(self, body: CompletionRequest | ChatCompletionRequest, base: GenerateParams, logprobs: int | None) -> list[GenerateParams]:
        """`n` generations of one prompt; with a seed, choice j uses seed + j (each differs, the
        whole request repeats)."""
        common = replace(base, adapter=self.agent.model_adapter(body.model), stop=body.stop_strings(), logprobs=logprobs, **body.sampling())
        return [replace(common, seed=None if body.seed is None else (body.seed + j) % SEED_LIMIT) for j in range(body.n)]

    async def _generate(self, request: web.Request, job: Generation) -> web.StreamResponse:
        """Admit `job`, run its choices, answer in one body or as a stream."""
        body, params, prompt_param = job.body, job.params, job.prompt_param
        await self._admit()
        try:
            choices = Choices(self.agent, params)
            try:
                first = await choices.first()
                failed = next((event.error for event in first if event.error is not None), None)
                if failed is not None:
                    raise self._refusal(failed, body.model, prompt_param)
                reply = Reply(job.kind, body.model, len(params), job.prompts, self._token_text, job.logprobs)
                if body.stream:
                    return await self._stream(request, reply, choices, first, len(params), body.include_usage)
                async for batch in _chain(first, choices):
                    for event in batch:
                        if event.error is not None:
                            raise self._refusal(event.error, body.model, prompt_param)
                        assert event.token is not None
                        reply.add(event.index, event.token)
                return web.json_response(reply.body(), dumps=_dumps)
            finally:
                choices.close()
        finally:
            if self._budget is not None:
                self._budget.release()

    async def _admit(self) -> None:
        """Take a place of the inference budget, waiting in its queue; 429 beyond the queue or
        its wait, 503 while stopping."""
        try:
            if self._closing.is_set():
                raise ShuttingDown("the agent is shutting down: inference is refused")
            if self._budget is not None:
                await self._budget.acquire_async()
        except AgentError as refusal:
            self.agent.metrics.failures.labels("http", refusal.reason).inc()
            raise from_agent_error(refusal, "prompt") from None

    async def _stream(
        self, request: web.Request, reply: Reply, choices: Choices, first: list[Event], count: int, include_usage: bool
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)

        async def send(*data: dict[str, Any] | str) -> None:
            """One write for all of `data`'s events."""
            await response.write("".join(f"data: {item if isinstance(item, str) else _dumps(item)}\n\n" for item in data).encode())

        try:
            await self._send_events(send, reply, choices, first, count, include_usage)
        except ConnectionResetError:
            return response  # the client went away mid-stream: `_generate` closes the choices
        except Exception as error:  # a bug after the 200: the error goes in the stream, then the end
            await send(internal_error(error, f"streaming {request.path}").body(), "[DONE]")
        await response.write_eof()
        return response

    async def _send_events(
        self, send: Callable[..., Awaitable[None]], reply: Reply, choices: Choices, first: list[Event], count: int, include_usage: bool
    ) -> None:
        """Every chunk of a stream, then `[DONE]`; an error after the 200 goes in the stream."""
        if reply.kind == "chat":
            await send(*(reply.role_chunk(index) for index in range(count)))
        async for batch in _chain(first, choices):
            chunks: list[dict[str, Any]] = []
            failed = next((event.error for event in batch if event.error is not None), None)
            for event in batch:
                if event.token is not None:
                    reply.add(event.index, event.token)
                    chunk = reply.chunk(event.index, event.token)
                    if chunk is not None:
                        chunks.append(chunk)
            if failed is not None:  # after the 200: the error goes in the stream, as vLLM does
                choices.close()
                await send(*chunks, self._refusal(failed, reply.model, "prompt").body())
                break
            if chunks:
                await send(*chunks)
        else:
            if include_usage:
                await send(reply.usage_chunk())
        await send("[DONE]")

    def _refusal(self, error: BaseException, model: str, prompt_param: str) -> ApiError:
        if isinstance(error, AdapterNotFound):
            return model_not_found(model, error)
        if isinstance(error, AgentError):
            return from_agent_error(error, prompt_param)
        return internal_error(error, "in a generation")

    def _token_text(self, token_id: int) -> str:
        tokenizer = self.agent.tokenizer
        if tokenizer is None:
            return f"token_id:{token_id}"
        return str(tokenizer.decode([token_id], skip_special_tokens=False))


async def _chain(first: list[Event], choices: Choices) -> AsyncIterator[list[Event]]:
    """The events `Choices.first` read, then the rest, in batches."""
    yield first
    async for batch in choices.batches():
        yield batch


M = TypeVar("M", bound=BaseModel)


def _parse(model: type[M], data: Any) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise from_validation_error(error) from None


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status, dumps=_dumps)
