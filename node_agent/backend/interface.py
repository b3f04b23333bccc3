"""The one interface between the agent and whatever holds adapters on ranks and serves them.

The builtin engine is one implementation (`node_agent.engine.EngineBackend`), the fleet-scale
benchmark's simulated agents another; a backend over stock inference servers fits the same shape
(each server a rank of the per-rank replies). A capability a backend lacks is refused with
`Unsupported`, never a silent no-op; `BackendDescription.capabilities` says which it has.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from node_agent.backend.files import FileDigests, WrittenFiles
from node_agent.backend.replies import ControlResult, ModuleShape, RankPlace


@dataclass(frozen=True)
class RankLayout:
    """How the ranks split the model (a backend without tensor parallelism: one rank each)."""

    tp_size: int
    dp_size: int
    attn_tp_size: int
    ep_size: int
    moe_tp_size: int
    fully_sharded_loras: bool


@dataclass(frozen=True)
class Capacity:
    """How many adapters, of what rank, the backend holds and serves at once."""

    max_lora_rank: int
    max_loras_per_batch: int  # device slots one batch can use
    max_loaded_loras: int  # adapters held (host and device together)


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do beyond loads, unloads and listings."""

    forward: bool = True  # prompt logits
    generate: bool = True  # a stream of sampled tokens
    pinning: bool = True  # adapters that keep a device slot
    replaces_in_place: bool = False  # a new version takes its name's place (no second place while both load)


@dataclass(frozen=True)
class BackendDescription:
    """What a backend is: its kind and version, the base model, its ranks, capacity and (where
    it knows them) every rank's LoRA buffer shapes. Fixed for the backend's life."""

    kind: str  # "lorafleet-engine", ...
    version: str
    model_dir: Path  # the base model's directory: config.json, tokenizer
    vocab_size: int
    layout: RankLayout
    ranks: tuple[RankPlace, ...]
    capacity: Capacity
    modules: tuple[ModuleShape, ...] = ()
    capabilities: Capabilities = Capabilities()
    endpoints: tuple[str, ...] = ()  # where each rank is served (a server's URL); () for own processes


@dataclass(frozen=True)
class RunningCommand:
    """The command the ranks are carrying out now: its kind, the adapter it names, since when."""

    command: str  # "load", "unload", "step", "describe"
    adapter: str | None  # the backend name of a load's or unload's adapter
    started: float  # time.monotonic()


@dataclass(frozen=True)
class Health:
    """Whether the backend serves, why not, what it is doing now, and which ranks run."""

    alive: bool
    failure: str  # "" while alive
    running: RunningCommand | None  # for hang detection: asks nothing of the ranks
    ranks_alive: tuple[bool, ...]  # rank order


@dataclass(frozen=True)
class RankHoldings:
    """The adapters one rank holds, in load order, as it says now."""

    rank: int
    holds: tuple[str, ...]


@dataclass(frozen=True)
class LoadRequest:
    """Load `name` from the verified snapshot at `path`. `expected`: the digests the caller
    verified (every rank must read exactly those bytes); `written`: the identities the files had
    when their writer hashed them (files still of these identities need no second hash)."""

    name: str
    path: Path
    pinned: bool = False
    expected: FileDigests | None = None
    written: WrittenFiles | None = None


@dataclass(frozen=True)
class SequenceInput:
    """One sequence of a forward batch; `adapter` None means the base model."""

    tokens: Sequence[int]
    adapter: str | None = None


@dataclass(frozen=True)
class Sampling:
    """How a generation draws its tokens, as the request asked; the backend checks the values
    (`RequestRefused` names the one out of range). `seed` None: the backend picks one."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None


@dataclass(frozen=True)
class ServingStats:
    """The serving loop's counters and the queue's state (metrics and tests)."""

    steps: int  # steps the ranks ran
    preemptions: int  # sequences preempted by recompute
    num_blocks: int  # KV blocks per DP group
    free_blocks: tuple[int, ...]  # per DP group
    running: int
    waiting: int
    running_adapters: frozenset[str]  # backend names of the adapters running sequences use
    waiting_adapters: frozenset[str]  # and of those waiting sequences ask for
    block_size: int = 0  # tokens per KV block (0: the backend keeps no KV cache of its own)


@dataclass(frozen=True)
class AdapterRequests:
    """One adapter's requests in the backend now (`adapter` None: the base model; a backend name)."""

    adapter: str | None
    running: int  # sequences being served
    waiting: int  # sequences queued for it


class StepLogprobs(Protocol):
    """A drawn token's logprob and the most likely tokens' (highest first)."""

    @property
    def logprob(self) -> float: ...
    @property
    def top_ids(self) -> tuple[int, ...]: ...
    @property
    def top_logprobs(self) -> tuple[float, ...]: ...


class StreamedStep(Protocol):
    """One token of a generation; `finish_reason` is "" until the last ("stop" or "length")."""

    @property
    def token_id(self) -> int: ...
    @property
    def logprobs(self) -> StepLogprobs | None: ...
    @property
    def finish_reason(self) -> str: ...


class TokenStream(Protocol):
    """A running generation: its steps as they complete; `cancel` frees what it holds."""

    @property
    def cancelled(self) -> bool:
        """Ended by `cancel` (the caller went away), not by a finish."""
        ...

    def tokens(self, poll_s: float = 0.1, cancelled: Callable[[], bool] | None = None) -> Iterator[StreamedStep]:
        """Each step as it completes; `BackendError` (or `SequenceAborted`) when it cannot go on.
        With `cancelled`, checked while waiting, the stream is cancelled and the iteration ends."""
        ...

    def cancel(self) -> bool:
        """Drop the sequence now; False if it had ended."""
        ...


class Backend(Protocol):
    """Holds adapters on ranks and serves them. Safe to call from many threads at once.

    Loads are all-or-nothing (`replies.all_or_nothing`); every control call answers with every
    rank's reply, merged failure-first. Names are the backend's own (the agent maps public names).
    """

    def describe(self) -> BackendDescription:
        """What the backend is (asks the ranks; `BackendError` when they cannot answer)."""
        ...

    def load(self, request: LoadRequest) -> ControlResult:
        """Load on every rank or on none. `AdapterRefused` (no rank asked), `LoadFailed` (some
        refused, the others rolled back), `Unsupported` (pinning without the capability)."""
        ...

    def unload(self, name: str) -> ControlResult:
        """Unload from every rank; `UnloadFailed` if some failed (the name is gone either way)."""
        ...

    def holding(self, name: str) -> ControlResult:
        """The answer to a load of an adapter already loaded, from what each rank last reported."""
        ...

    def holdings(self) -> list[RankHoldings]:
        """What every rank holds now (asks the ranks), rank order."""
        ...

    def forward(self, sequences: Sequence[SequenceInput]) -> list[np.ndarray]:
        """Logits (float32, [len(tokens), vocab]) of every sequence, in input order."""
        ...

    def generate(self, tokens: Sequence[int], adapter: str | None, sampling: Sampling) -> TokenStream:
        """Queue one sequence; its tokens arrive as the backend runs it (`Overloaded`,
        `RequestRefused`, `BackendError`)."""
        ...

    @property
    def alive(self) -> bool:
        """True while the backend serves (cheap: asked on every call)."""
        ...

    def health(self) -> Health:
        """Liveness, the reason it failed, the command running now and each rank's liveness."""
        ...

    def serving_stats(self) -> ServingStats:
        """The serving counters the metrics export at scrape time."""
        ...

    def adapter_requests(self) -> tuple[AdapterRequests, ...]:
        """Running and waiting requests per adapter, only those with any (asks no rank; cheap
        enough for every statistics call)."""
        ...

    def close(self) -> None:
        """Stop serving and release every rank."""
        ...
