"""The node agent's domain: one engine, its adapter registry, sources, metrics and call logs.

No gRPC here: `node_agent.server` converts messages and maps `AgentError` classes to status
codes. Every method is safe to call from many threads at once.

Per-rank truth: control results and ListAdapters report what each rank's pool actually holds
(asked from the ranks after the command), merged failure-first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType

import numpy as np

from lorafleet_common.merge import merge_failure_first
from node_agent.engine import AdapterLoadError, Engine, EngineConfig, EngineError, RankLoadError, RankUnloadError, SequenceInput, Topology
from node_agent.engine.engine import ADAPTER_NAME
from node_agent.engine.worker import RankReply
from node_agent.errors import (
    AdapterConflict,
    AgentError,
    CapacityExceeded,
    EngineUnavailable,
    InvalidRequest,
    RequestAborted,
)
from node_agent.metrics import AgentMetrics
from node_agent.registry import AdapterEntry, Lease, Registry
from node_agent.sources import ResolvedSource, SourcePolicy, clean_cache, parse_sha256, resolve_source
from node_agent.text import IncrementalDecoder, eos_token_ids, load_tokenizer

log = logging.getLogger(__name__)
call_log = logging.getLogger("lorafleet.agent.calls")

DEFAULT_NEW_TOKENS = 16


@dataclass(frozen=True)
class AgentConfig:
    """Agent settings beyond the engine's; `serve` fills them from its flags."""

    base_model_name: str = ""  # "" = the model directory's name
    agent_id: str = field(default_factory=socket.gethostname)
    sources: SourcePolicy = SourcePolicy()
    drain_timeout_s: float = 30.0  # how long unload/replace wait for running requests
    max_new_tokens: int = 1024  # the most a Generate may ask for
    max_request_tokens: int = 16384  # tokens in one Forward batch or one Generate sequence


# -- results -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankOutcome:
    """One rank's answer to a control call, with the adapters it holds afterwards."""

    rank: int
    attn_dp_rank: int
    attn_tp_rank: int
    ok: bool
    error: str
    loaded: tuple[str, ...]


@dataclass(frozen=True)
class ControlResult:
    """The merged answer of a LoadAdapter/UnloadAdapter and every rank's part in it."""

    ok: bool
    error: str
    loaded: tuple[str, ...]
    ranks: tuple[RankOutcome, ...]
    already_loaded: bool = False


def merge_rank_outcomes(outcomes: Sequence[RankOutcome], already_loaded: bool = False) -> ControlResult:
    """Failure-first: success only if every rank succeeded; the loaded list is the first rank's
    on success, the first failed rank's otherwise; distinct errors joined with " | "."""
    merged = merge_failure_first(outcomes, lambda o: o.ok, lambda o: o.error)
    return ControlResult(merged.ok, merged.error, merged.reply.loaded, tuple(outcomes), already_loaded)


def rolled_back(result: ControlResult) -> ControlResult:
    """A failed load as the ranks end up: those that loaded it unloaded it again (rollback), so
    they are reported as not holding it. The merged error keeps only the ranks' own failures."""
    failed = ", ".join(str(o.rank) for o in result.ranks if not o.ok)
    note = f"loaded, then rolled back because the load failed on rank {failed}"
    return replace(result, ranks=tuple(o if not o.ok else replace(o, ok=False, error=note) for o in result.ranks))


@dataclass(frozen=True)
class RankStatus:
    rank: int
    attn_dp_rank: int
    attn_tp_rank: int
    alive: bool


@dataclass(frozen=True)
class ModuleShape:
    """Per-slot LoRA buffer shapes of one module on one rank, one (A, B) pair per fused slice."""

    module: str
    rank: int
    slices: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


@dataclass(frozen=True)
class Description:
    agent_id: str
    base_model_name: str
    config_sha256: str
    topology: Topology
    max_lora_rank: int
    max_loras_per_batch: int
    max_loaded_loras: int
    ranks: tuple[RankStatus, ...]
    modules: tuple[ModuleShape, ...]
    has_tokenizer: bool


@dataclass(frozen=True)
class AdapterStatus:
    name: str
    source_uri: str
    sha256: str
    pinned: bool
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class GenerateParams:
    token_ids: tuple[int, ...] = ()
    prompt: str = ""
    adapter: str | None = None
    max_new_tokens: int = 0  # 0 = DEFAULT_NEW_TOKENS
    stop_token_ids: tuple[int, ...] = ()  # () = the model's eos ids


@dataclass(frozen=True)
class GeneratedToken:
    token_id: int
    text: str
    finish_reason: str  # "" until the last token: "stop" or "length"


# -- the agent -----------------------------------------------------------------------------------


class Agent:
    """An engine served to callers: routing, atomic loads, drains, validation, metrics, logs."""

    def __init__(self, engine: Engine, config: AgentConfig, metrics: AgentMetrics | None = None) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics or AgentMetrics()
        self.registry = Registry()
        model_dir = Path(engine.config.model_dir)
        self.base_model_name = config.base_model_name or model_dir.resolve().name
        self._config_sha256 = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()
        # Buffer shapes are fixed for the engine's life: asked once, so Describe answers even
        # after a rank died (it is how an operator sees which rank).
        self._modules = _module_shapes(self._describe_ranks())
        self.tokenizer = load_tokenizer(model_dir)
        self._eos = eos_token_ids(model_dir)
        if config.sources.cache_dir is not None:
            clean_cache(config.sources.cache_dir)
        self.metrics.engine_up.set(1)

    @classmethod
    def start(cls, engine_config: EngineConfig, config: AgentConfig, metrics: AgentMetrics | None = None) -> Agent:
        """Start an engine (its rank processes) and serve it."""
        engine = Engine(engine_config)
        try:
            return cls(engine, config, metrics)
        except BaseException:
            engine.close()
            raise

    def close(self) -> None:
        self.engine.close()
        for entry in self.registry.held():
            entry.source.discard()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- health ----------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """True while every rank process runs and no call failed the engine."""
        alive = self.engine.alive
        self.metrics.engine_up.set(1 if alive else 0)
        return alive

    def failure(self) -> str:
        """Why the engine is not serving ("" while it is)."""
        if self.alive:
            return ""
        return self.engine.failure or "a rank process exited"

    def _check_alive(self) -> None:
        if not self.alive:
            raise EngineUnavailable(f"engine is not serving: {self.failure()}; the agent exits so its pod restarts")

    def _engine_error(self, error: EngineError) -> AgentError:
        if not self.alive:
            return EngineUnavailable(f"engine is not serving: {error}; the agent exits so its pod restarts")
        return AgentError(f"engine error: {error}", "engine_error")

    # -- Describe / ListAdapters -----------------------------------------------------------------

    def describe(self) -> Description:
        config = self.engine.config
        topology = config.topology
        alive = _ranks_running(self.engine.pids, topology.tp_size, self.alive)
        ranks = tuple(
            RankStatus(c.rank, c.attn_dp_rank, c.attn_tp_rank, alive[c.rank])
            for c in (topology.coords(rank) for rank in range(topology.tp_size))
        )
        return Description(
            agent_id=self.config.agent_id,
            base_model_name=self.base_model_name,
            config_sha256=self._config_sha256,
            topology=topology,
            max_lora_rank=config.max_lora_rank,
            max_loras_per_batch=config.max_loras_per_batch,
            max_loaded_loras=config.max_loaded_loras,
            ranks=ranks,
            modules=self._modules,
            has_tokenizer=self.tokenizer is not None,
        )

    def list_adapters(self) -> list[AdapterStatus]:
        self._check_alive()
        holdings = self._holdings()
        return [
            AdapterStatus(
                entry.name, entry.source.uri, entry.source.content.weights_sha256, entry.pinned,
                tuple(rank for rank, names in sorted(holdings.items()) if entry.engine_name in names),
            )
            for entry in self.registry.entries()
        ]

    # -- LoadAdapter -----------------------------------------------------------------------------

    def load(self, name: str, source_uri: str, sha256: str = "", pinned: bool = False, replace_existing: bool = False) -> ControlResult:
        """Load `name` on every rank or on none; idempotent for the same content and pinning."""
        with ControlCall(self, "load", name, source=source_uri) as call:
            _check_name(name)
            expected = parse_sha256(sha256)
            if not source_uri:
                raise InvalidRequest("source_uri is required")
            with self.registry.serialised(name):
                self._check_alive()
                current = self.registry.get(name)
                if current is not None and _unchanged(current, source_uri, expected, pinned):
                    call.already_loaded = True  # same URI, promised digest and pinning: no fetch
                    return call.result(self._holding_result(current))
                source = resolve_source(source_uri, expected, self.config.sources)
                if current is not None and current.source.content == source.content and current.pinned == pinned:
                    source.discard()
                    self.registry.update(replace(current, source=replace(current.source, uri=source_uri)))
                    call.already_loaded = True
                    return call.result(self._holding_result(current))
                if current is not None and not replace_existing:
                    source.discard()
                    raise AdapterConflict(_conflict_message(current, source.content.weights_sha256, pinned))
                return call.result(self._load_version(name, source, pinned))

    def _load_version(self, name: str, source: ResolvedSource, pinned: bool) -> ControlResult:
        """Load a new version under a fresh engine name; publish it; retire the one it replaces."""
        engine_name = self.registry.new_engine_name(name)
        try:
            replies = self.engine.load_adapter(engine_name, source.path, pinned)
        except RankLoadError as error:  # refused somewhere; the engine rolled the others back
            source.discard()
            return rolled_back(self._result(error.replies))
        except AdapterLoadError as error:
            source.discard()
            raise InvalidRequest(str(error)) from None
        except EngineError as error:
            source.discard()
            raise self._engine_error(error) from None
        previous = self.registry.publish(AdapterEntry(name, engine_name, source, pinned))
        self.metrics.loaded_adapters.set(len(self.registry.entries()))
        if previous is not None:
            old = merge_failure_first(self._retire(previous), lambda r: r.ok, lambda r: r.error)
            if not old.ok:
                log.error("replaced %s, but unloading its previous version failed: %s", name, old.error)
        return self._result(replies)

    # -- UnloadAdapter ---------------------------------------------------------------------------

    def unload(self, name: str) -> ControlResult:
        """Refuse new requests for `name` at once, wait (bounded) for running ones, unload."""
        with ControlCall(self, "unload", name) as call:
            _check_name(name)
            with self.registry.serialised(name):
                self._check_alive()
                entry = self.registry.withdraw(name)
                self.metrics.loaded_adapters.set(len(self.registry.entries()))
                return call.result(self._result(self._retire(entry)))

    def _retire(self, entry: AdapterEntry) -> list[RankReply]:
        """Drain a version that no longer routes, then unload it from every rank."""
        if not self.registry.wait_idle(entry.engine_name, self.config.drain_timeout_s):
            log.warning("adapter %s: %d requests still running after %.0fs; unloading anyway (they are aborted)",
                        entry.name, self.registry.in_flight(entry.engine_name), self.config.drain_timeout_s)
        try:
            return self.engine.unload_adapter(entry.engine_name)
        except RankUnloadError as error:
            return error.replies
        except EngineError as error:
            raise self._engine_error(error) from None
        finally:
            self.registry.forget(entry)
            entry.source.discard()

    # -- Forward / Generate ----------------------------------------------------------------------

    def forward(self, sequences: Sequence[tuple[Sequence[int], str | None]]) -> list[np.ndarray]:
        """Logits (float32 [tokens, vocab]) of each sequence, in order; adapter None = base."""
        with InferenceCall(self, "forward"):
            if not sequences:
                raise InvalidRequest("a forward needs at least one sequence")
            self._check_tokens([list(tokens) for tokens, _ in sequences], "sequence")
            self._check_alive()
            with self._leased([adapter for _, adapter in sequences if adapter]) as lease:
                inputs = [SequenceInput(list(tokens), lease.engine_name(adapter)) for tokens, adapter in sequences]
                return [logits.numpy() for logits in self._engine_forward(inputs, lease)]

    def generate(self, params: GenerateParams, cancelled: Callable[[], bool] = lambda: False) -> Iterator[GeneratedToken]:
        """Greedy decoding, one token per step. The engine keeps no KV cache, so every step
        recomputes the whole sequence: O(n^2) in the generated length (bounded by max_new_tokens)."""
        with InferenceCall(self, "generate") as call:
            tokens = self._prompt_ids(params)
            max_new = params.max_new_tokens or DEFAULT_NEW_TOKENS
            if not 1 <= max_new <= self.config.max_new_tokens:
                raise InvalidRequest(f"max_new_tokens must be within [1, {self.config.max_new_tokens}], got {max_new}")
            self._check_tokens([tokens], "prompt", extra=max_new)
            stop = set(params.stop_token_ids or self._eos)
            self._check_alive()
            with self._leased([params.adapter] if params.adapter else []) as lease:
                decoder = IncrementalDecoder(self.tokenizer) if self.tokenizer is not None else None
                for step in range(max_new):
                    if cancelled():
                        call.outcome = "cancelled"
                        return
                    logits = self._engine_forward([SequenceInput(tokens, lease.engine_name(params.adapter))], lease)[0]
                    token = int(np.argmax(logits[-1].numpy()))  # first maximum: deterministic ties
                    tokens.append(token)
                    finish = "stop" if token in stop else "length" if step == max_new - 1 else ""
                    self.metrics.generated_tokens.inc()
                    yield GeneratedToken(token, decoder.push(token) if decoder else "", finish)
                    if finish:
                        return

    def _prompt_ids(self, params: GenerateParams) -> list[int]:
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

    def _check_tokens(self, batches: list[list[int]], what: str, extra: int = 0) -> None:
        vocab = self.engine.model_config.vocab_size
        for index, tokens in enumerate(batches):
            if not tokens:
                raise InvalidRequest(f"{what} {index} has no tokens")
            bad = next((t for t in tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequest(f"{what} {index} has token id {bad} outside the vocabulary [0, {vocab})")
        total = sum(len(tokens) for tokens in batches) + extra
        if total > self.config.max_request_tokens:
            raise InvalidRequest(f"the request needs {total} tokens, over the limit of {self.config.max_request_tokens}")

    @contextmanager
    def _leased(self, adapters: Sequence[str]) -> Iterator[Lease]:
        """Hold the adapters' current versions for the whole request (NOT_FOUND if unroutable)."""
        lease = self.registry.acquire(adapters)
        try:
            self._check_slots(lease)
            yield lease
        finally:
            self.registry.release(lease)

    def _check_slots(self, lease: Lease) -> None:
        # Pinned adapters keep their device slots: a batch fits only if its adapters and the
        # pinned ones together fit, which is exactly when the ranks' pools can serve it.
        pinned = {entry.engine_name for entry in self.registry.held() if entry.pinned}
        needed = set(lease.engine_names.values()) | pinned
        slots = self.engine.config.max_loras_per_batch
        if len(needed) > slots:
            raise CapacityExceeded(
                f"the batch needs {len(needed)} LoRA slots ({len(lease.engine_names)} adapters, "
                f"{len(pinned)} pinned adapters hold slots) but the engine has {slots} (--max-loras-per-batch)"
            )

    def _engine_forward(self, inputs: list[SequenceInput], lease: Lease) -> list:
        try:
            return self.engine.forward(inputs)
        except EngineError as error:
            revoked = self.registry.revoked(lease)
            if revoked:
                raise RequestAborted(f"adapter {revoked[0]!r} was unloaded while the request ran (drain timeout)") from None
            raise self._engine_error(error) from None

    # -- per-rank results ------------------------------------------------------------------------

    def _describe_ranks(self) -> list[RankReply]:
        try:
            replies = self.engine.describe()
        except EngineError as error:
            raise self._engine_error(error) from None
        merged = merge_failure_first(replies, lambda r: r.ok, lambda r: r.error)
        if not merged.ok:
            raise AgentError(f"engine error: {merged.error}", "engine_error")
        return replies

    def _holdings(self) -> dict[int, list[str]]:
        """Engine names each rank's pool holds now."""
        return {reply.rank: list(reply.payload["loaded"]) for reply in self._describe_ranks()}

    def _public(self, engine_names: list[str]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.registry.public_name(name) for name in engine_names))

    def _result(self, replies: list[RankReply]) -> ControlResult:
        holdings = self._holdings()
        return merge_rank_outcomes([
            RankOutcome(r.rank, r.attn_dp_rank, r.attn_tp_rank, r.ok, r.error, self._public(holdings[r.rank]))
            for r in replies
        ])

    def _holding_result(self, entry: AdapterEntry) -> ControlResult:
        """An idempotent load's result: each rank succeeded if it holds the current version."""
        holdings = self._holdings()
        topology = self.engine.config.topology
        outcomes = []
        for rank, names in sorted(holdings.items()):
            coords = topology.coords(rank)
            held = entry.engine_name in names
            outcomes.append(RankOutcome(rank, coords.attn_dp_rank, coords.attn_tp_rank, held,
                                        "" if held else f"rank {rank} does not hold {entry.name!r}", self._public(names)))
        return merge_rank_outcomes(outcomes, already_loaded=True)


# -- call bookkeeping ----------------------------------------------------------------------------


class ControlCall:
    """Times one control call; records its metric, failure reason and one structured log line."""

    def __init__(self, agent: Agent, operation: str, adapter: str, **fields: object) -> None:
        self.agent, self.operation, self.adapter, self.fields = agent, operation, adapter, fields
        self.outcome = "ok"
        self.error = ""
        self.already_loaded = False

    def result(self, result: ControlResult) -> ControlResult:
        if not result.ok:
            self.outcome, self.error = "rank_failed", result.error
        return result

    def __enter__(self) -> ControlCall:
        self.started = time.monotonic()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if isinstance(exc, AgentError):
            self.outcome, self.error = exc.reason, str(exc)
        elif exc is not None:
            self.outcome, self.error = "internal", f"{type(exc).__name__}: {exc}"
        duration = time.monotonic() - self.started
        metrics = self.agent.metrics
        histogram = metrics.load_seconds if self.operation == "load" else metrics.unload_seconds
        histogram.labels(self.outcome).observe(duration)
        if self.outcome != "ok":
            metrics.failures.labels(self.operation, self.outcome).inc()
        line = {"call": self.operation, "adapter": self.adapter, "outcome": self.outcome,
                "duration_ms": round(duration * 1000, 1), **self.fields}
        if self.operation == "load":
            line["already_loaded"] = self.already_loaded
        if self.error:
            line["error"] = self.error
        call_log.log(logging.INFO if self.outcome == "ok" else logging.WARNING, json.dumps(line, sort_keys=True))


class InferenceCall:
    """Counts and times one Forward/Generate by outcome (a Generate: its whole stream)."""

    def __init__(self, agent: Agent, method: str) -> None:
        self.agent, self.method = agent, method
        self.outcome = "ok"

    def __enter__(self) -> InferenceCall:
        self.started = time.monotonic()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if isinstance(exc, AgentError):
            self.outcome = exc.reason
        elif isinstance(exc, GeneratorExit):
            self.outcome = "cancelled"  # the caller stopped reading the stream
        elif exc is not None:
            self.outcome = "internal"
        metrics = self.agent.metrics
        metrics.requests.labels(self.method, self.outcome).inc()
        metrics.request_seconds.labels(self.method).observe(time.monotonic() - self.started)
        if self.outcome not in ("ok", "cancelled"):
            metrics.failures.labels(self.method, self.outcome).inc()


# -- helpers -------------------------------------------------------------------------------------


def _check_name(name: str) -> None:
    if not ADAPTER_NAME.match(name or ""):
        raise InvalidRequest(f"invalid adapter name {name!r} (letters, digits, '.', '_', '-'; at most 253 characters)")


def _unchanged(entry: AdapterEntry, uri: str, sha256: str | None, pinned: bool) -> bool:
    """The request names exactly what is loaded (same URI, promised digest and pinning)."""
    return sha256 is not None and entry.source.uri == uri and entry.source.content.weights_sha256 == sha256 and entry.pinned == pinned


def _conflict_message(entry: AdapterEntry, new_sha256: str, pinned: bool) -> str:
    if entry.source.content.weights_sha256 == new_sha256 and entry.pinned != pinned:
        return f"adapter {entry.name!r} is loaded with pinned={entry.pinned}; set replace to change it"
    return (f"adapter {entry.name!r} is loaded with other content (sha256 {entry.source.content.weights_sha256}, "
            f"new {new_sha256}); set replace to swap it")


def _module_shapes(replies: list[RankReply]) -> tuple[ModuleShape, ...]:
    shapes = []
    for reply in replies:
        for module, buffers in reply.payload["modules"].items():
            slices = tuple((tuple(a), tuple(b)) for a, b in zip(buffers["a"], buffers["b"]))
            shapes.append(ModuleShape(module, reply.rank, slices))
    return tuple(shapes)


def _ranks_running(pids: list[int], tp_size: int, engine_alive: bool) -> list[bool]:
    """Whether each rank process runs, from /proc (an exited, unreaped zombie does not); without
    /proc (not Linux) every rank gets the engine's overall liveness."""
    if len(pids) != tp_size:
        return [False] * tp_size  # the engine was closed
    if not Path("/proc/self/stat").exists():
        return [engine_alive] * tp_size
    running = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            running.append(False)
            continue
        running.append(stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X"))
    return running
