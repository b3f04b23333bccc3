"""The agent's domain values: what its calls take and return, without gRPC.

`node_agent.convert` maps them to and from `lorafleet.v1` messages. A LoadAdapter/UnloadAdapter
answers with the backend's `ControlResult` itself (every rank's reply, merged once), its adapter
names turned into public ones by the agent.
"""

from __future__ import annotations

from dataclasses import dataclass

from node_agent.backend import ModuleShape, RankLayout

DEFAULT_NEW_TOKENS = 16  # what a Generate without max_new_tokens produces


@dataclass(frozen=True)
class RankStatus:
    """One rank's coordinates and whether its process runs."""

    rank: int
    attn_dp_rank: int
    attn_tp_rank: int
    alive: bool


@dataclass(frozen=True)
class BackendIdentity:
    """What holds and serves the adapters: its kind, its version and where each rank is served
    (empty for the builtin engine's own processes)."""

    kind: str
    version: str
    endpoints: tuple[str, ...]


@dataclass(frozen=True)
class Description:
    """Describe: who the agent is, its backend, model, topology, capacity, ranks and LoRA buffer
    shapes."""

    agent_id: str
    base_model_name: str
    config_sha256: str
    topology: RankLayout
    max_lora_rank: int
    max_loras_per_batch: int
    max_loaded_loras: int
    ranks: tuple[RankStatus, ...]
    modules: tuple[ModuleShape, ...]
    has_tokenizer: bool
    backend: BackendIdentity


@dataclass(frozen=True)
class GenerateParams:
    """A Generate request: token ids or a text prompt, the adapter, how many tokens, stop ids."""

    token_ids: tuple[int, ...] = ()
    prompt: str = ""
    adapter: str | None = None
    max_new_tokens: int = 0  # 0 = DEFAULT_NEW_TOKENS
    stop_token_ids: tuple[int, ...] = ()  # () = the model's eos ids
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None  # None: the engine picks one
    logprobs: int | None = None  # None: none; N: the token's and the N most likely
    stop: tuple[str, ...] = ()  # stop strings (text mode), node_agent.text.StopStrings


@dataclass(frozen=True)
class GeneratedToken:
    """One streamed step of a Generate."""

    token_id: int
    text: str
    finish_reason: str  # "" until the last token: "stop" or "length"
    logprob: float | None = None  # with GenerateParams.logprobs
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), highest first
    usage: tuple[int, int] | None = None  # on the last token: (prompt tokens, generated tokens)


@dataclass(frozen=True)
class AfterLoad:
    """What a successful load left (empty after a failed one): what its source resolved to (""
    for a source that names none) and whether the adapter is on standby."""

    revision: str = ""
    standby: bool | None = None  # None: no successful load to say it of
