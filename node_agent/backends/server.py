"""One stock inference server as a backend over several of them sees it: the calls it answers
and the plain values it answers with. `node_agent.backends.vllm.VllmServer` is one; an SGLang
server is another client of the same shape (docs/vllm.md, "Another server")."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from node_agent.backend import Sampling


@dataclass(frozen=True)
class Refusal:
    """A server's failed answer: its HTTP status (0: no answer), the server's error type and
    message, and whether asking again can change it (permanent) or may not (transient)."""

    status: int
    error_type: str
    message: str
    permanent: bool

    def describe(self) -> str:
        """One line for a rank's reply: "permanent: 400 InvalidUserInput: <message>"."""
        kind = "permanent" if self.permanent else "transient"
        answer = f"{self.status} {self.error_type}" if self.status else self.error_type
        return f"{kind}: {answer}: {self.message}"


@dataclass(frozen=True)
class ServerModels:
    """What a server lists: its base model's id, and each adapter it holds (id, the path it was
    loaded from), in the server's order."""

    base: str
    adapters: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class TopLogprobs:
    """A drawn token's logprob and the most likely tokens' (highest first): the seam's
    `StepLogprobs`."""

    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclass(frozen=True)
class CompletionStep:
    """One streamed token: the seam's `StreamedStep`."""

    token_id: int
    logprobs: TopLogprobs | None
    finish_reason: str  # "" until the last: "stop" or "length"


@dataclass(frozen=True)
class ServerRequests:
    """A server's requests now, as its own metrics say: how many run and wait (whoever sent
    them), and the adapters its running and waiting requests name (served names)."""

    running: int
    waiting: int
    running_adapters: frozenset[str]
    waiting_adapters: frozenset[str]


class StreamBroken(Exception):
    """A streamed completion failed after it started; `refusal` is the server's error event."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.describe())
        self.refusal = refusal


class InferenceServer(Protocol):
    """One server's runtime-LoRA and completion endpoints. Every call is one request; none
    raises for the server's answer (a `Refusal` says what it was). Safe from many threads."""

    @property
    def url(self) -> str: ...

    def load(self, name: str, path: str) -> Refusal | None:
        """Load `name` from `path`, replacing a version of that name the server holds."""
        ...

    def unload(self, name: str) -> Refusal | None:
        """Drop `name`."""
        ...

    def models(self) -> ServerModels | Refusal:
        """The base model and the adapters the server holds now."""
        ...

    def version(self) -> str:
        """The server's software and version ("vllm 0.32.0"; "vllm, version unknown" when it
        does not answer)."""
        ...

    def requests(self) -> ServerRequests | Refusal:
        """The requests the server runs and queues now, every client's (its metrics)."""
        ...

    def complete(self, model: str, tokens: Sequence[int], sampling: Sampling) -> Iterator[CompletionStep] | Refusal:
        """Stream a completion of the token ids `tokens` by `model` (the base or an adapter):
        its steps as they arrive (`StreamBroken` if it fails later, `OSError` if the connection
        does), or the refusal before the first. Closing the iterator ends
        the request on the server."""
        ...
