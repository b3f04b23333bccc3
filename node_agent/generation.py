"""A Generate request's own parts, apart from the engine: its prompt's token ids, its sampling,
its stop strings, and each streamed step as the `GeneratedToken` callers get (text decoded
incrementally, stop strings applied once for gRPC and HTTP alike)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from node_agent.backend import Sampling, StreamedStep
from node_agent.errors import InvalidRequest
from node_agent.text import IncrementalDecoder, StopStrings
from node_agent.values import DEFAULT_NEW_TOKENS, GeneratedToken, GenerateParams


class Prompting:
    """The model's tokenizer (None: token ids only) and end-of-sequence ids, as requests use them."""

    def __init__(self, tokenizer: Any | None, eos: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.eos = tuple(eos)

    def prompt_ids(self, params: GenerateParams) -> list[int]:
        """The request's prompt as token ids (given, or its text encoded)."""
        if params.token_ids and params.prompt:
            raise InvalidRequest("give token_ids or prompt, not both")
        if params.token_ids:
            return list(params.token_ids)
        if not params.prompt:
            raise InvalidRequest("a generate needs token_ids or a prompt")
        if self.tokenizer is None:
            raise InvalidRequest("this agent's model has no tokenizer (tokenizer.json): send token_ids")
        ids = list(self.tokenizer.encode(params.prompt).ids)
        if not ids:
            raise InvalidRequest("the prompt encodes to no tokens")
        return ids

    def sampling(self, params: GenerateParams) -> Sampling:
        """How the request draws its tokens; without stop token ids, the model's eos ids end it."""
        return Sampling(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            seed=params.seed,
            max_tokens=new_tokens(params),
            stop_token_ids=tuple(params.stop_token_ids or self.eos),
            logprobs=params.logprobs,
        )

    def stop_strings(self, stop: tuple[str, ...]) -> StopStrings | None:
        """The request's stop-string matcher (None without stop strings); they need text."""
        if not stop:
            return None
        if self.tokenizer is None:
            raise InvalidRequest("stop strings need text: this agent's model has no tokenizer (tokenizer.json)")
        try:
            return StopStrings(stop)
        except ValueError as error:
            raise InvalidRequest(str(error)) from None

    def stream(self, steps: Iterator[StreamedStep], prompt_len: int, stops: StopStrings | None) -> Iterator[GeneratedToken]:
        """Each step as a `GeneratedToken`: its text, and where a stop string matched, the end
        (the iteration stops there; the caller cancels the sequence)."""
        decoder = IncrementalDecoder(self.tokenizer) if self.tokenizer is not None else None
        for count, step in enumerate(steps, start=1):
            finish = step.finish_reason
            text = decoder.push(step.token_id) if decoder else ""
            if stops is not None:
                text = stops.push(text)
                if stops.matched is not None:
                    finish = "stop"
                elif finish:
                    text += stops.flush()
            yield _token(step, text, finish, (prompt_len, count) if finish else None)
            if stops is not None and stops.matched is not None:
                return


def new_tokens(params: GenerateParams) -> int:
    """How many tokens the request may generate."""
    return params.max_new_tokens or DEFAULT_NEW_TOKENS


def _token(step: StreamedStep, text: str, finish: str, usage: tuple[int, int] | None) -> GeneratedToken:
    lp = step.logprobs
    return GeneratedToken(
        step.token_id,
        text,
        finish,
        logprob=lp.logprob if lp is not None else None,
        top_logprobs=tuple(zip(lp.top_ids, lp.top_logprobs, strict=True)) if lp else (),
        usage=usage,
    )
