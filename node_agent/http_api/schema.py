"""The HTTP API's requests as pydantic models: types, bounds and defaults in one declaration.

Every refusal names the parameter (pydantic's error location, e.g. `messages.0.role`), which
becomes the `param` of the OpenAI error. Fields OpenAI defines but the engine does not offer are
ignored, as vLLM does, except those whose effect a client would rely on (`echo`, penalties, ...),
which are refused when set to anything but their neutral value.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 16  # choices of one request
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for completions
MAX_LOGPROBS = 20  # the engine's limit (SamplingParams)
SEED_LIMIT = 2**64

Seed = Annotated[int, Field(ge=0, lt=SEED_LIMIT)]


class StreamOptions(BaseModel):
    """`stream_options`: with `include_usage`, a last chunk carries the usage of the request."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Sampling(BaseModel):
    """What completions and chat completions share: the model, sampling, stop, n, streaming."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM: -1 (and 0) turn it off
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: Seed | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Not offered: only the neutral value is accepted (clients send it as a default).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
    @classmethod
    def _neutral_only(cls, value: Any, info: Any) -> Any:
        neutral = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "logit_bias": {}}[info.field_name]
        if value is not None and value != neutral:
            raise ValueError(f"{info.field_name} is not supported by this server (only {neutral!r})")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling(self) -> dict[str, Any]:
        """The engine's sampling fields of this request (OpenAI's defaults where unset)."""
        return dict(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            min_p=self.min_p or 0.0,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]


class CompletionRequest(_Sampling):
    """`POST /v1/completions`."""

    prompt: Text | TokenIds | Annotated[list[Text], Field(min_length=1)] | Annotated[list[TokenIds], Field(min_length=1)]
    max_tokens: int | None = Field(default=DEFAULT_COMPLETION_TOKENS, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("echo", "best_of", "suffix")
    @classmethod
    def _not_offered(cls, value: Any, info: Any) -> Any:
        neutral = {"echo": False, "best_of": 1, "suffix": None}[info.field_name]
        if value is not None and (value is not neutral if isinstance(neutral, bool) else value != neutral):
            raise ValueError(f"{info.field_name} is not supported by this server (only {neutral!r})")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one text or token list, or several (each gets `n` choices)."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        items: list[Any] = list(self.prompt)
        return [items] if all(isinstance(item, int) for item in items) else items


class TextPart(BaseModel):
    """One part of a message's content; only text parts are offered."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; fields beyond role and content (name, tool_calls, ...) reach the template."""

    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1)
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template sees it: text parts joined by newlines, as vLLM does."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content)
        return message


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True  # vLLM's extension: render the assistant turn's header

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self
