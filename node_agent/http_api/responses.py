"""The bodies the HTTP API answers with, in OpenAI's shapes: completions and chat completions,
whole or as stream chunks, with usage and logprobs.

One `Reply` per request accumulates each choice's tokens; `chunk()` gives the stream chunk of
one event, `body()` the whole answer once every choice has ended.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from node_agent.values import GeneratedToken

Kind = Literal["completion", "chat"]


@dataclass(frozen=True)
class _Logprob:
    token: str
    logprob: float
    top: list[tuple[str, float]]  # the most likely tokens and their logprobs, highest first
    offset: int  # where the token's text starts in the choice's text


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    length: int = 0  # characters of text so far
    logprobs: list[_Logprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Reply:
    """The answer to one completion or chat request, built as its choices' tokens arrive."""

    def __init__(self, kind: Kind, model: str, choices: int, prompts: int, token_text: Callable[[int], str], logprobs: bool) -> None:
        """`choices` over `prompts` prompts (n each, in prompt order); `token_text(id)` is one
        token's text for logprobs; `logprobs`: whether the request asked for them."""
        self.kind, self.model = kind, model
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id = f"{prefix}-{secrets.token_hex(16)}"
        self.created = int(time.time())
        self._choices = [_Choice() for _ in range(choices)]
        self._per_prompt = choices // prompts
        self._token_text = token_text
        self._logprobs = logprobs

    def add(self, index: int, token: GeneratedToken) -> None:
        """Record one token of choice `index`."""
        choice = self._choices[index]
        if self._logprobs and token.logprob is not None:
            choice.logprobs.append(
                _Logprob(
                    self._token_text(token.token_id),
                    token.logprob,
                    [(self._token_text(t), lp) for t, lp in token.top_logprobs],
                    choice.length,
                )
            )
        choice.text.append(token.text)
        choice.length += len(token.text)
        if token.finish_reason:
            choice.finish_reason = token.finish_reason
        if token.usage is not None:
            choice.prompt_tokens, choice.completion_tokens = token.usage

    # -- whole answers ---------------------------------------------------------------------------

    def body(self) -> dict[str, Any]:
        """The non-streaming answer."""
        if self.kind == "chat":
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": "".join(c.text)},
                    "logprobs": self._chat_logprobs(c.logprobs),
                    "finish_reason": c.finish_reason,
                }
                for i, c in enumerate(self._choices)
            ]
        else:
            choices = [
                {"index": i, "text": "".join(c.text), "logprobs": self._completion_logprobs(c.logprobs), "finish_reason": c.finish_reason}
                for i, c in enumerate(self._choices)
            ]
        return {**self._head(), "choices": choices, "usage": self.usage()}

    def usage(self) -> dict[str, int]:
        """Token counts: each prompt once (not once per choice), every choice's generated tokens."""
        prompt = sum(c.prompt_tokens for c in self._choices[:: self._per_prompt])
        completion = sum(c.completion_tokens for c in self._choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # -- stream chunks ---------------------------------------------------------------------------

    def role_chunk(self, index: int) -> dict[str, Any]:
        """A chat stream's first chunk of a choice: the assistant role."""
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])

    def chunk(self, index: int, token: GeneratedToken) -> dict[str, Any] | None:
        """The chunk of one token (after `add`), or None when it carries nothing to send (text
        held back for a possible stop string, no logprobs asked, not the last token)."""
        entries = self._choices[index].logprobs[-1:] if self._logprobs and token.logprob is not None else []
        finish = token.finish_reason or None
        if not token.text and not entries and finish is None:
            return None
        if self.kind == "chat":
            delta = {"content": token.text} if token.text or finish is None else {}
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": self._chat_logprobs(entries) if entries else None,
                "finish_reason": finish,
            }
        else:
            choice = {
                "index": index,
                "text": token.text,
                "logprobs": self._completion_logprobs(entries) if entries else None,
                "finish_reason": finish,
            }
        return self._chunk([choice])

    def usage_chunk(self) -> dict[str, Any]:
        """`stream_options.include_usage`: the last chunk, no choices, the request's usage."""
        return {**self._chunk([]), "usage": self.usage()}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        head = self._head()
        head["object"] = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**head, "choices": choices}

    def _head(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
        }

    # -- logprobs --------------------------------------------------------------------------------

    def _chat_logprobs(self, entries: list[_Logprob]) -> dict[str, Any] | None:
        if not self._logprobs:
            return None
        return {
            "content": [
                {
                    "token": e.token,
                    "logprob": e.logprob,
                    "bytes": list(e.token.encode()),
                    "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in e.top],
                }
                for e in entries
            ]
        }

    def _completion_logprobs(self, entries: list[_Logprob]) -> dict[str, Any] | None:
        if not self._logprobs:
            return None
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(e.top) for e in entries],
            "text_offset": [e.offset for e in entries],
        }
