"""The node agent's domain: one engine served to callers, its adapter registry and sources.

No gRPC here: `node_agent.server` converts messages and maps `AgentError` classes to status
codes. Requests are checked by `node_agent.validation`, calls are counted and logged by
`node_agent.calls`, and results are the values of `node_agent.values` and the engine's
`ControlResult`. Every method is safe to call from many threads at once.

Per-rank truth: a load or unload reports what each rank's pool holds afterwards, as the ranks
said in their replies to that very command (merged failure-first, once, by the engine);
ListAdapters asks the ranks.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from torch import Tensor

from lorafleet_common.registry import RegistryEntry
from node_agent.calls import ControlCall, InferenceCall
from node_agent.engine import (
    AdapterLoadError,
    ContentChanged,
    ControlResult,
    DescribeReply,
    Engine,
    EngineConfig,
    EngineError,
    QueueFull,
    RankLoadError,
    RankUnloadError,
    SamplingParams,
    SchedulerError,
    SequenceAborted,
    SequenceInput,
)
from node_agent.errors import (
    AdapterConflict,
    AgentError,
    CapacityExceeded,
    EngineUnavailable,
    InvalidRequest,
    RequestAborted,
    SourceUnavailable,
    TooManyCalls,
)
from node_agent.metrics import AgentMetrics
from node_agent.registry import AdapterEntry, Lease, Registry
from node_agent.sources import (
    DownloadProgress,
    ResolvedSource,
    SourceCredential,
    SourcePolicy,
    clean_cache,
    parse_sha256,
    resolve_source,
)
from node_agent.text import IncrementalDecoder, StopStrings, eos_token_ids, load_tokenizer
from node_agent.validation import check_adapter_name, check_forward, check_generate
from node_agent.values import DEFAULT_NEW_TOKENS, Description, GeneratedToken, GenerateParams, RankStatus

log = logging.getLogger(__name__)

DEFAULT_ENGINE_HANG_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class AgentConfig:
    """Agent settings beyond the engine's; `serve` fills them from its flags."""

    base_model_name: str = ""  # "" = the model directory's name
    agent_id: str = field(default_factory=socket.gethostname)
    sources: SourcePolicy = field(default_factory=SourcePolicy)
    drain_timeout_s: float = 30.0  # how long unload/replace wait for running requests
    max_new_tokens: int = 1024  # the most a Generate may ask for
    max_request_tokens: int = 16384  # tokens in one Forward batch or one Generate sequence
    # an engine command running longer than this makes health NOT_SERVING until it completes
    # (well under the engine's call timeout, 300 s, after which the engine counts as dead)
    engine_hang_timeout_s: float = DEFAULT_ENGINE_HANG_TIMEOUT_S


class Agent:
    """An engine served to callers: routing, atomic loads, drains, validation, metrics, logs."""

    def __init__(self, engine: Engine, config: AgentConfig, metrics: AgentMetrics | None = None) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics or AgentMetrics()
        self.registry = Registry()
        # Names whose source is downloading now, and its progress (ListAdapters shows them).
        self.downloading: dict[str, DownloadProgress] = {}
        model_dir = Path(engine.config.model_dir)
        self.base_model_name = config.base_model_name or model_dir.resolve().name
        self._config_sha256 = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()
        # Buffer shapes are fixed for the engine's life: asked once, so Describe answers even
        # after a rank died (it is how an operator sees which rank).
        self._modules = tuple(module for reply in self._describe_ranks() for module in reply.modules)
        self.tokenizer = load_tokenizer(model_dir)
        self._eos = eos_token_ids(model_dir)
        if config.sources.cache_dir is not None:
            clean_cache(config.sources.cache_dir)
        self.metrics.engine_up.set(1)
        self.metrics.serve_engine(engine.serving_stats, self.adapter_name, engine.config.max_loras_per_batch)

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

    def hang(self) -> str:
        """Why the engine counts as hung ("" while it does not): the command the ranks are
        carrying out has run longer than `engine_hang_timeout_s`. Asks nothing of the ranks."""
        running = self.engine.running
        if running is None:
            return ""
        elapsed = time.monotonic() - running.started
        limit = self.config.engine_hang_timeout_s
        if elapsed < limit:
            return ""
        what = running.command
        if running.adapter is not None:
            what += f" of adapter {_public_of(running.adapter)!r} (engine name {running.adapter!r})"
        return f"the engine's {what} has been running for {elapsed:.1f} s, over the {limit:g}-s --engine-hang-timeout-s"

    def adapter_name(self, engine_name: str) -> str:
        """The public name of an engine's adapter name (also of a version already forgotten)."""
        name = self.registry.public_name(engine_name)
        return _public_of(engine_name) if name == engine_name else name

    def model_adapter(self, model: str) -> str | None:
        """The adapter an OpenAI-style `model` names: None for the base model's name, else the
        adapter of that name (whether it is routable is checked when a request leases it)."""
        return None if model == self.base_model_name else model

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

    def list_adapters(self) -> list[RegistryEntry]:
        """Routable adapters, in load order, each with the ranks whose pool holds it (asked now)."""
        self._check_alive()
        # Sets: every entry is looked up in every rank's holdings (a thousand names each).
        holdings = {reply.rank: frozenset(reply.holds) for reply in self._describe_ranks()}
        return [
            RegistryEntry(
                entry.name,
                entry.source.uri,
                entry.source.content.weights_sha256,
                entry.pinned,
                tuple(rank for rank, names in sorted(holdings.items()) if entry.engine_name in names),
            )
            for entry in self.registry.entries()
        ]

    # -- LoadAdapter -----------------------------------------------------------------------------

    def load(
        self,
        name: str,
        source_uri: str,
        sha256: str = "",
        pinned: bool = False,
        replace_existing: bool = False,
        credential: SourceCredential | None = None,
    ) -> ControlResult:
        """Load `name` on every rank or on none; idempotent for the same content and pinning.
        `credential` authenticates the download of an http(s) or hf:// source (never logged)."""
        with ControlCall(self.metrics, "load", name, source=source_uri) as call:
            check_adapter_name(name)
            expected = parse_sha256(sha256)
            if not source_uri:
                raise InvalidRequest("source_uri is required")
            with self.registry.serialised(name):
                self._check_alive()
                current = self.registry.get(name)
                if current is not None and _unchanged(current, source_uri, expected, pinned):
                    return call.result(self._holding(current))  # same URI, promised digest and pinning: no fetch
                # One load per name at a time (serialised), so the entry is this load's own.
                self.downloading[name] = progress = DownloadProgress()
                try:
                    source = resolve_source(source_uri, expected, self.config.sources, credential, progress)
                finally:
                    del self.downloading[name]
                with _discarded_on_failure(source):
                    if current is not None and current.source.content == source.content and current.pinned == pinned:
                        source.discard()
                        self.registry.update(replace(current, source=replace(current.source, uri=source_uri)))
                        return call.result(self._holding(current))
                    if current is not None and not replace_existing:
                        raise AdapterConflict(_conflict_message(current, source.content.weights_sha256, pinned))
                result = self._load_version(name, source, pinned)
                if _read_other_bytes(result):
                    return call.result(result, "digest_mismatch")
                return call.result(result)

    def _load_version(self, name: str, source: ResolvedSource, pinned: bool) -> ControlResult:
        """Load a new version under a fresh engine name; publish it; retire the one it replaces.
        Every rank must have read exactly the bytes the source verified (their digests)."""
        engine_name = self.registry.new_engine_name(name)
        try:
            with _discarded_on_failure(source):  # every failure, expected or not: no snapshot stays behind
                result = self.engine.load_adapter(engine_name, source.path, pinned, expected=source.content, written=source.written)
        except RankLoadError as error:  # refused somewhere (or read other bytes); the engine rolled the others back
            source.discard()
            return self._public(error.result)
        except ContentChanged as error:  # the snapshot changed before the driver read it: fetch again
            raise SourceUnavailable(str(error), "digest_mismatch") from None
        except AdapterLoadError as error:
            raise InvalidRequest(str(error)) from None
        except EngineError as error:
            raise self._engine_error(error) from None
        previous = self.registry.publish(AdapterEntry(name, engine_name, source, pinned))
        self.metrics.loaded_adapters.set(len(self.registry.entries()))
        published = self._public(result)  # while the registry still knows the previous version's name
        if previous is not None:
            old = self._retire(previous)
            if not old.ok:
                log.error("replaced %s, but unloading its previous version failed: %s", name, old.error)
        return published

    # -- UnloadAdapter ---------------------------------------------------------------------------

    def unload(self, name: str) -> ControlResult:
        """Refuse new requests for `name` at once, wait (bounded) for running ones, unload."""
        with ControlCall(self.metrics, "unload", name) as call:
            check_adapter_name(name)
            with self.registry.serialised(name):
                self._check_alive()
                entry = self.registry.withdraw(name)
                self.metrics.loaded_adapters.set(len(self.registry.entries()))
                return call.result(self._public(self._retire(entry)))

    def _retire(self, entry: AdapterEntry) -> ControlResult:
        """Drain a version that no longer routes, then unload it from every rank."""
        if not self.registry.wait_idle(entry.engine_name, self.config.drain_timeout_s):
            log.warning(
                "adapter %s: %d requests still running after %.0fs; unloading anyway (they are aborted)",
                entry.name,
                self.registry.in_flight(entry.engine_name),
                self.config.drain_timeout_s,
            )
        try:
            return self.engine.unload_adapter(entry.engine_name)
        except RankUnloadError as error:
            return error.result
        except EngineError as error:
            raise self._engine_error(error) from None
        finally:
            self.registry.forget(entry)
            entry.source.discard()

    # -- Forward / Generate ----------------------------------------------------------------------

    def forward(self, sequences: Sequence[tuple[Sequence[int], str | None]]) -> list[np.ndarray]:
        """Logits (float32 [tokens, vocab]) of each sequence, in order; adapter None = base."""
        with InferenceCall(self.metrics, "forward"):
            check_forward([tokens for tokens, _ in sequences], self.engine.model_config.vocab_size, self.config.max_request_tokens)
            self._check_alive()
            with self._leased([adapter for _, adapter in sequences if adapter]) as lease:
                inputs = [SequenceInput(list(tokens), lease.engine_name(adapter)) for tokens, adapter in sequences]
                return [logits.numpy() for logits in self._engine_forward(inputs, lease)]

    def generate(self, params: GenerateParams, cancelled: Callable[[], bool] = lambda: False) -> Generator[GeneratedToken]:
        """Submit to the engine's scheduler and stream each token as its step completes; the
        request shares steps with every other running one (docs/serving.md). The adapter's
        lease is held until the last token, so unload and replace drain it; a call that goes
        away (`cancelled`, or the stream closed) cancels the sequence and frees its blocks."""
        with InferenceCall(self.metrics, "generate") as call:
            tokens = self._prompt_ids(params)
            max_new = params.max_new_tokens or DEFAULT_NEW_TOKENS
            config = self.config
            check_generate(tokens, max_new, config.max_new_tokens, self.engine.model_config.vocab_size, config.max_request_tokens)
            try:
                sampling = SamplingParams(
                    temperature=params.temperature,
                    top_p=params.top_p,
                    top_k=params.top_k,
                    min_p=params.min_p,
                    seed=params.seed,
                    max_tokens=max_new,
                    stop_token_ids=tuple(params.stop_token_ids or self._eos),
                    logprobs=params.logprobs,
                )
            except ValueError as error:
                raise InvalidRequest(str(error)) from None
            stops = self._stop_strings(params.stop)
            self._check_alive()
            with self._leased([params.adapter] if params.adapter else []) as lease:
                try:
                    generation = self.engine.submit(tokens, lease.engine_name(params.adapter), sampling)
                except QueueFull as error:
                    raise TooManyCalls(f"the engine's waiting queue is full: {error}", reason="queue_full") from None
                except SchedulerError as error:
                    raise InvalidRequest(str(error)) from None
                except EngineError as error:
                    raise self._engine_error(error) from None
                decoder = IncrementalDecoder(self.tokenizer) if self.tokenizer is not None else None
                try:
                    for count, step in enumerate(generation.tokens(cancelled=cancelled), start=1):
                        finish = step.finish.value if step.finish is not None else ""
                        self.metrics.generated_tokens.inc()
                        text = decoder.push(step.token_id) if decoder else ""
                        if stops is not None:
                            text = stops.push(text)
                            if stops.matched is not None:
                                finish = "stop"
                            elif finish:
                                text += stops.flush()
                        lp = step.logprobs
                        yield GeneratedToken(
                            step.token_id,
                            text,
                            finish,
                            logprob=lp.logprob if lp is not None else None,
                            top_logprobs=tuple(zip(lp.top_ids, lp.top_logprobs, strict=True)) if lp else (),
                            usage=(len(tokens), count) if finish else None,
                        )
                        if stops is not None and stops.matched is not None:
                            break  # the stop string ended it: `finally` cancels the sequence now
                    if generation.cancelled:
                        call.outcome = "cancelled"
                except SequenceAborted:
                    raise RequestAborted(f"adapter {params.adapter!r} was unloaded while the request ran (drain timeout)") from None
                except EngineError as error:
                    revoked = self.registry.revoked(lease)
                    if revoked:
                        raise RequestAborted(f"adapter {revoked[0]!r} was unloaded while the request ran (drain timeout)") from None
                    raise self._engine_error(error) from None
                finally:
                    generation.cancel()  # the stream closed early: free its blocks now (no-op once done)

    def _stop_strings(self, stop: tuple[str, ...]) -> StopStrings | None:
        """The request's stop-string matcher (None without stop strings); they need text."""
        if not stop:
            return None
        if self.tokenizer is None:
            raise InvalidRequest("stop strings need text: this agent's model has no tokenizer (tokenizer.json)")
        try:
            return StopStrings(stop)
        except ValueError as error:
            raise InvalidRequest(str(error)) from None

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

    def _engine_forward(self, inputs: list[SequenceInput], lease: Lease) -> list[Tensor]:
        try:
            return self.engine.forward(inputs)
        except EngineError as error:
            revoked = self.registry.revoked(lease)
            if revoked:
                raise RequestAborted(f"adapter {revoked[0]!r} was unloaded while the request ran (drain timeout)") from None
            raise self._engine_error(error) from None

    # -- per-rank results ------------------------------------------------------------------------

    def _describe_ranks(self) -> list[DescribeReply]:
        try:
            return self.engine.describe()
        except EngineError as error:
            raise self._engine_error(error) from None

    def _public(self, result: ControlResult) -> ControlResult:
        """`result` with public adapter names instead of engine names (versions of one name once)."""
        # Every reply lists all a rank holds, and the ranks mostly hold the same: each distinct
        # holding is mapped once (compared, not hashed), not ranks x held lookups per reply.
        mapped: list[tuple[tuple[str, ...], tuple[str, ...]]] = []

        def public(names: tuple[str, ...]) -> tuple[str, ...]:
            for engine_names, public_names in mapped:
                if engine_names == names:
                    return public_names
            mapped.append((names, self.registry.public_names(names)))
            return mapped[-1][1]

        ranks = tuple(replace(reply, holds=public(reply.holds)) for reply in result.ranks)
        return replace(result, holds=public(result.holds), ranks=ranks)

    def _holding(self, entry: AdapterEntry) -> ControlResult:
        """An idempotent load's result: each rank succeeded if it holds the current version."""
        return self._public(self.engine.holding(entry.engine_name))


# -- helpers -------------------------------------------------------------------------------------


@contextmanager
def _discarded_on_failure(source: ResolvedSource) -> Iterator[None]:
    """Remove the source's private copy if the block fails in any way (it then owns nothing)."""
    try:
        yield
    except BaseException:
        source.discard()
        raise


def _read_other_bytes(result: ControlResult) -> list[int]:
    """The ranks of a load that refused because the files were not those the source verified."""
    return [reply.rank for reply in result.ranks if reply.read_other_bytes]


def _public_of(engine_name: str) -> str:
    """The public name inside an engine name (`<name>.<generation>`, registry.new_engine_name)."""
    return engine_name.rsplit(".", 1)[0]


def _unchanged(entry: AdapterEntry, uri: str, sha256: str | None, pinned: bool) -> bool:
    """The request names exactly what is loaded (same URI, promised digest and pinning)."""
    return sha256 is not None and entry.source.uri == uri and entry.source.content.weights_sha256 == sha256 and entry.pinned == pinned


def _conflict_message(entry: AdapterEntry, new_sha256: str, pinned: bool) -> str:
    if entry.source.content.weights_sha256 == new_sha256 and entry.pinned != pinned:
        return f"adapter {entry.name!r} is loaded with pinned={entry.pinned}; set replace to change it"
    return (
        f"adapter {entry.name!r} is loaded with other content (sha256 {entry.source.content.weights_sha256}, "
        f"new {new_sha256}); set replace to swap it"
    )


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
