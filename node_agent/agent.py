"""The node agent's domain: one backend served to callers, its adapter registry and sources.

The agent knows its backend only through the seam (`node_agent.backend.Backend`): the builtin
engine (`Agent.start`) is one, the fleet-scale benchmark's simulated agents another. No gRPC
here: `node_agent.server` converts messages and maps `AgentError` classes to status codes.
Requests are checked by `node_agent.validation`, calls are counted and logged by
`node_agent.calls`, a Generate's prompt, sampling and text come from `node_agent.generation`,
and results are the values of `node_agent.values` and the seam's `ControlResult`. Every method
is safe to call from many threads at once.

Per-rank truth: a load or unload reports what each rank holds afterwards, as the ranks said in
their replies to that very command (merged failure-first, once, by the backend); ListAdapters
asks the ranks.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np

from lorafleet_common.registry import RegistryEntry
from node_agent.adapter_stats import AdapterStatsSnapshot, DemandRecorder, RequestCounts
from node_agent.backend import (
    AdapterRefused,
    Backend,
    BackendError,
    ControlReply,
    ControlResult,
    LoadFailed,
    LoadRequest,
    RequestRefused,
    Sampling,
    SequenceAborted,
    SequenceInput,
    TokenStream,
    UnloadFailed,
    merge_control,
)
from node_agent.calls import ControlCall, InferenceCall
from node_agent.engine import EngineBackend, EngineConfig
from node_agent.errors import (
    AdapterConflict,
    AgentError,
    CapacityExceeded,
    EngineUnavailable,
    InvalidRequest,
    LoadCancelled,
    RequestAborted,
    backend_refusal,
)
from node_agent.generation import Prompting, new_tokens
from node_agent.metrics import AgentMetrics
from node_agent.registry import AdapterEntry, Lease, Registry, public_of
from node_agent.residency import OnDemand, OnDemandSettings, capacity_refusal
from node_agent.residency_metrics import serve_residency
from node_agent.sources import (
    Credential,
    DownloadProgress,
    ResolvedSource,
    SourceAccess,
    SourcePolicy,
    clean_cache,
    parse_sha256,
    resolve_source,
)
from node_agent.text import eos_token_ids, load_tokenizer
from node_agent.validation import check_adapter_name, check_forward, check_generate
from node_agent.values import AfterLoad, BackendIdentity, Description, GeneratedToken, GenerateParams, RankStatus

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
    on_demand: OnDemandSettings = field(default_factory=OnDemandSettings)  # standby adapters' loads on first request


#: How the agent turns a LoadAdapter source into a verified private snapshot (`resolve_source`;
#: the simulated agents share one check per process): uri, sha256, policy, credential, progress.
SourceResolver = Callable[[str, str | None, SourcePolicy, Credential | None, DownloadProgress | None, str], ResolvedSource]


class Agent:
    """A backend served to callers: routing, atomic loads, drains, validation, metrics, logs.

    `engine` is the backend (the builtin engine's `EngineBackend` when built by `start`);
    `resolve` checks and copies sources (default: `resolve_source`)."""

    def __init__(
        self, engine: Backend, config: AgentConfig, metrics: AgentMetrics | None = None, resolve: SourceResolver = resolve_source
    ) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics or AgentMetrics()
        self.registry = Registry()
        self.demand = DemandRecorder(self.metrics.adapters)  # tokens and times to first token per adapter (AdapterStats)
        self._resolve = resolve
        # Names whose source is downloading now, and its progress (ListAdapters shows them).
        self.downloading: dict[str, DownloadProgress] = {}
        # Fixed for the backend's life, buffer shapes included: asked once, so Describe answers
        # even after a rank died (it is how an operator sees which rank).
        try:
            self.backend = engine.describe()
        except BackendError as error:
            raise self._engine_error(error) from None
        self.model_dir = self.backend.model_dir
        capacity = self.backend.capacity.max_loaded_loras
        self.on_demand = OnDemand(engine, self.registry, capacity, config.on_demand, self.metrics.lora_load_seconds.observe)
        self.base_model_name = config.base_model_name or self.model_dir.resolve().name
        self._config_sha256 = hashlib.sha256((self.model_dir / "config.json").read_bytes()).hexdigest()
        self.tokenizer = load_tokenizer(self.model_dir)
        self._prompting = Prompting(self.tokenizer, eos_token_ids(self.model_dir))
        if config.sources.cache_dir is not None:
            clean_cache(config.sources.cache_dir)
        self.metrics.engine_up.set(1)
        self.metrics.serve_engine(engine.serving_stats, self.adapter_name, self.backend.capacity.max_loras_per_batch)
        serve_residency(self.metrics, self.registry, capacity)
        self.metrics.watch_standby_memory(self.on_demand.memory)

    @classmethod
    def start(cls, engine_config: EngineConfig, config: AgentConfig, metrics: AgentMetrics | None = None) -> Agent:
        """Start the builtin engine (its rank processes) and serve it."""
        backend = EngineBackend.start(engine_config)
        try:
            return cls(backend, config, metrics)
        except BaseException:
            backend.close()
            raise

    def close(self) -> None:
        self.on_demand.close()
        self.engine.close()
        for entry in self.registry.held() + self.registry.entries():  # standby versions are routable, not held
            entry.source.discard()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- health ----------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """True while the backend serves (every rank runs and no call failed it)."""
        alive = self.engine.alive
        self.metrics.engine_up.set(1 if alive else 0)
        return alive

    def failure(self) -> str:
        """Why the engine is not serving ("" while it is)."""
        if self.alive:
            return ""
        return self.engine.health().failure

    def hang(self) -> str:
        """Why the engine counts as hung ("" while it does not): the command the ranks are
        carrying out has run longer than `engine_hang_timeout_s`. Asks nothing of the ranks."""
        running = self.engine.health().running
        if running is None:
            return ""
        elapsed = time.monotonic() - running.started
        limit = self.config.engine_hang_timeout_s
        if elapsed < limit:
            return ""
        what = running.command
        if running.adapter is not None:
            what += f" of adapter {public_of(running.adapter)!r} (engine name {running.adapter!r})"
        return f"the engine's {what} has been running for {elapsed:.1f} s, over the {limit:g}-s --engine-hang-timeout-s"

    def adapter_name(self, engine_name: str) -> str:
        """The public name of an engine's adapter name (also of a version already forgotten)."""
        return self.registry.adapter_name(engine_name)

    def model_adapter(self, model: str) -> str | None:
        """The adapter an OpenAI-style `model` names: None for the base model's name, else the
        adapter of that name (whether it is routable is checked when a request leases it)."""
        return None if model == self.base_model_name else model

    def _check_alive(self) -> None:
        if not self.alive:
            raise EngineUnavailable(f"engine is not serving: {self.failure()}; the agent exits so its pod restarts")

    def _engine_error(self, error: BackendError | AdapterRefused | RequestRefused) -> AgentError:
        return backend_refusal(error, self.alive)

    # -- Describe / ListAdapters -----------------------------------------------------------------

    def describe(self) -> Description:
        backend, capacity = self.backend, self.backend.capacity
        self.metrics.engine_up.set(1 if self.engine.alive else 0)
        alive = self.engine.health().ranks_alive
        return Description(
            agent_id=self.config.agent_id,
            base_model_name=self.base_model_name,
            config_sha256=self._config_sha256,
            topology=backend.layout,
            max_lora_rank=capacity.max_lora_rank,
            max_loras_per_batch=capacity.max_loras_per_batch,
            max_loaded_loras=capacity.max_loaded_loras,
            ranks=tuple(RankStatus(p.rank, p.attn_dp_rank, p.attn_tp_rank, alive[p.rank]) for p in backend.ranks),
            modules=backend.modules,
            has_tokenizer=self.tokenizer is not None,
            backend=BackendIdentity(backend.kind, backend.version, backend.endpoints),
        )

    def list_adapters(self) -> list[RegistryEntry]:
        """Routable adapters, in load order, each with the ranks whose pool holds it (asked now)."""
        self._check_alive()
        # Sets: every entry is looked up in every rank's holdings (a thousand names each).
        try:
            holdings = {ranks.rank: frozenset(ranks.holds) for ranks in self.engine.holdings()}
        except BackendError as error:
            raise self._engine_error(error) from None
        return [
            RegistryEntry(
                entry.name,
                entry.source.uri,
                entry.source.content.weights_sha256,
                entry.pinned,
                () if entry.standby else tuple(rank for rank, names in sorted(holdings.items()) if entry.engine_name in names),
                standby=entry.standby,
            )
            for entry in self.registry.entries()
        ]

    def adapter_stats(self) -> AdapterStatsSnapshot:
        """Each held adapter's demand (in load order, then the base model as ""): the backend's
        running and waiting requests now, the tokens and times to first token the agent saw
        over the recent window. Asks no rank."""
        self._check_alive()
        counts: dict[str, RequestCounts] = {}
        for requests in self.engine.adapter_requests():
            name = "" if requests.adapter is None else self.adapter_name(requests.adapter)
            before = counts.get(name, RequestCounts())  # versions of one adapter (a replace) add up
            counts[name] = RequestCounts(before.running + requests.running, before.waiting + requests.waiting)
        names = [entry.name for entry in self.registry.entries()] + [""]
        return self.demand.snapshot(names, counts)

    # -- LoadAdapter -----------------------------------------------------------------------------

    def load(
        self,
        name: str,
        source_uri: str,
        sha256: str = "",
        pinned: bool = False,
        replace_existing: bool = False,
        access: SourceAccess | None = None,
        *,
        standby: bool = False,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> ControlResult:
        """Load `name` on every rank or on none; idempotent for the same content and pinning.
        `access`: the credential that authenticates the download of a remote source (never
        logged), and the revision the source must still resolve to (`resolve_source`).
        `standby`: verify and keep the snapshot, and load it on its first request
        (`node_agent.residency`); an adapter already resident goes back on standby in place.
        Once `cancelled()` (the call ended) the load stops before it reaches the ranks: its
        download is stopped (LoadCancelled); a load already on the ranks completes."""
        with ControlCall(self.metrics, "load", name, source=source_uri) as call:
            check_adapter_name(name)
            expected = parse_sha256(sha256)
            if not source_uri:
                raise InvalidRequest("source_uri is required")
            if standby and pinned:
                raise InvalidRequest("a standby adapter cannot be pinned: pinning keeps it resident")
            with self.registry.serialised(name):
                self._check_alive()
                current = self.registry.get(name)
                if current is not None and current.is_exactly(source_uri, expected, pinned):
                    return call.result(self._kept(current, standby))  # same URI, promised digest and pinning: no fetch
                # One load per name at a time (serialised), so the entry is this load's own.
                self.downloading[name] = progress = DownloadProgress(cancelled)
                try:
                    access = access or SourceAccess()
                    source = self._resolve(source_uri, expected, self.config.sources, access.credential, progress, access.revision)
                finally:
                    del self.downloading[name]
                with _discarded_on_failure(source):
                    if cancelled():
                        raise LoadCancelled(
                            f"the load of {name!r} was cancelled before it reached the ranks: its call ended (the client's "
                            "deadline passed, or it cancelled); nothing was loaded"
                        )
                    if current is not None and current.source.content == source.content and current.pinned == pinned:
                        source.discard()
                        self.registry.update(replace(current, source=replace(current.source, uri=source_uri)))
                        return call.result(self._kept(current, standby))
                    if current is not None and not replace_existing:
                        raise AdapterConflict(current.conflict(source.content.weights_sha256, pinned))
                if standby:
                    return call.result(self._load_standby(name, source))
                result = self._load_version(name, source, pinned)
                if _read_other_bytes(result):
                    return call.result(result, "digest_mismatch")
                return call.result(result)

    def after_load(self, name: str, result: ControlResult) -> AfterLoad:
        """What a successful load of `name` left: what its source resolved to
        (`ResolvedSource.revision`) and whether it is on standby now; empty after a failed one."""
        entry = self.registry.get(name)
        return AfterLoad(entry.source.revision, entry.standby) if result.ok and entry is not None else AfterLoad()

    def _kept(self, current: AdapterEntry, standby: bool) -> ControlResult:
        """A load that found its content under the name: made resident, or put back on standby in
        place, as it asked (`OnDemand.settle`)."""
        return self._holding(self.on_demand.settle(current, standby=standby))

    def _load_standby(self, name: str, source: ResolvedSource) -> ControlResult:
        """Publish a verified snapshot on standby (no rank is asked); retire the version it replaces."""
        self.on_demand.memory.offer(source, wait=True)  # its copy in host memory, if it fits (node_agent.standby_memory)
        previous = self.registry.publish(AdapterEntry(name, self.registry.new_engine_name(name), source, False, standby=True))
        self.metrics.loaded_adapters.set(len(self.registry.entries()))
        if previous is not None:
            old = self._retire(previous)
            if not old.ok:
                log.error("replaced %s by a standby version, but unloading its previous version failed: %s", name, old.error)
        return self._standby_result()

    def _load_version(self, name: str, source: ResolvedSource, pinned: bool) -> ControlResult:
        """Load a new version under a fresh engine name; publish it; retire the one it replaces.
        Every rank must have read exactly the bytes the source verified (their digests)."""
        engine_name = self.registry.new_engine_name(name)
        capacity = self.backend.capacity.max_loaded_loras
        in_place_of = self.registry.get(name) if self.backend.capabilities.replaces_in_place else None
        place = self.registry.reserve_place(capacity, in_place_of)  # places reserved by on-demand loads count as taken
        if place is None:
            source.discard()
            return capacity_refusal(self.backend.ranks, self.registry, capacity)
        try:
            with _discarded_on_failure(source), self.registry.place_given_back_on_failure(place):
                result = self.engine.load(LoadRequest(engine_name, source.path, pinned, source.content, source.written))
        except LoadFailed as error:  # refused somewhere (or read other bytes); the backend rolled the others back
            source.discard()
            return self.registry.public_result(error.result)
        except (AdapterRefused, BackendError) as error:
            raise self._engine_error(error) from None
        previous = self.registry.publish(AdapterEntry(name, engine_name, source, pinned), place)
        self.metrics.loaded_adapters.set(len(self.registry.entries()))
        published = self.registry.public_result(result)  # while the registry still knows the previous version's name
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
                self.demand.forget(name)
                self.metrics.loaded_adapters.set(len(self.registry.entries()))
                return call.result(self.registry.public_result(self._retire(entry)))

    def _retire(self, entry: AdapterEntry) -> ControlResult:
        """Drain a version that no longer routes, then unload it from every rank (a standby
        version: no rank holds it)."""
        if entry.standby:
            self.registry.forget(entry)
            self.on_demand.memory.drop(entry.source)
            entry.source.discard()
            return self._standby_result()
        if not self.registry.wait_idle(entry.engine_name, self.config.drain_timeout_s):
            log.warning(
                "adapter %s: %d requests still running after %.0fs; unloading anyway (they are aborted)",
                entry.name,
                self.registry.in_flight(entry.engine_name),
                self.config.drain_timeout_s,
            )
        try:
            return self.engine.unload(entry.engine_name)
        except UnloadFailed as error:
            return error.result
        except BackendError as error:
            raise self._engine_error(error) from None
        finally:
            self.registry.forget(entry)
            self.on_demand.memory.drop(entry.source)
            entry.source.discard()

    # -- Forward / Generate ----------------------------------------------------------------------

    def forward(self, sequences: Sequence[tuple[Sequence[int], str | None]]) -> list[np.ndarray]:
        """Logits (float32 [tokens, vocab]) of each sequence, in order; adapter None = base."""
        with InferenceCall(self.metrics, "forward"):
            check_forward([tokens for tokens, _ in sequences], self.backend.vocab_size, self.config.max_request_tokens)
            self._check_alive()
            with self._leased([adapter for _, adapter in sequences if adapter]) as lease:
                inputs = [SequenceInput(list(tokens), lease.engine_name(adapter)) for tokens, adapter in sequences]
                try:
                    return self.engine.forward(inputs)
                except RequestRefused as error:
                    raise self._engine_error(error) from None
                except BackendError as error:
                    raise self._inference_error(error, lease) from None

    def generate(self, params: GenerateParams, cancelled: Callable[[], bool] = lambda: False) -> Generator[GeneratedToken]:
        """Submit to the backend and stream each token as its step completes; the request shares
        steps with every other running one (docs/serving.md). The adapter's lease is held until
        the last token, so unload and replace drain it; a call that goes away (`cancelled`, or
        the stream closed) cancels the sequence and frees its blocks."""
        with InferenceCall(self.metrics, "generate") as call:
            prompting, config = self._prompting, self.config
            tokens = prompting.prompt_ids(params)
            check_generate(tokens, new_tokens(params), config.max_new_tokens, self.backend.vocab_size, config.max_request_tokens)
            sampling = prompting.sampling(params)
            stops = prompting.stop_strings(params.stop)
            self._check_alive()
            measure = self.demand.request(params.adapter, len(tokens))
            with self._leased([params.adapter] if params.adapter else []) as lease:
                stream = self._submit(tokens, lease.engine_name(params.adapter), sampling)
                try:
                    for token in prompting.stream(stream.tokens(cancelled=cancelled), len(tokens), stops):
                        self.metrics.generated_tokens.inc()
                        measure.token()
                        yield token
                    if stream.cancelled:
                        call.outcome = "cancelled"
                except BackendError as error:
                    raise self._inference_error(error, lease, params.adapter) from None
                finally:
                    stream.cancel()  # the stream closed early or a stop string ended it: free its blocks now (no-op once done)

    def _submit(self, tokens: list[int], adapter: str | None, sampling: Sampling) -> TokenStream:
        try:
            return self.engine.generate(tokens, adapter, sampling)
        except (RequestRefused, BackendError) as error:
            raise self._engine_error(error) from None

    def _inference_error(self, error: BackendError, lease: Lease, adapter: str | None = None) -> AgentError:
        """A Forward's or Generate's failure as the caller sees it: aborted when its adapter
        (`adapter`, a Generate's) was unloaded under it (a drain that timed out)."""
        if isinstance(error, SequenceAborted) and adapter is not None:
            return RequestAborted(f"adapter {adapter!r} was unloaded while the request ran (drain timeout)")
        revoked = self.registry.revoked(lease)
        if revoked:
            return RequestAborted(f"adapter {revoked[0]!r} was unloaded while the request ran (drain timeout)")
        return self._engine_error(error)

    @contextmanager
    def _leased(self, adapters: Sequence[str]) -> Iterator[Lease]:
        """Hold the adapters' current versions for the whole request (NOT_FOUND if unroutable)."""
        lease = self.on_demand.lease(adapters)  # loads standby adapters first (node_agent.residency)
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
        slots = self.backend.capacity.max_loras_per_batch
        if len(needed) > slots:
            raise CapacityExceeded(
                f"the batch needs {len(needed)} LoRA slots ({len(lease.engine_names)} adapters, "
                f"{len(pinned)} pinned adapters hold slots) but the engine has {slots} (--max-loras-per-batch)"
            )

    # -- per-rank results ------------------------------------------------------------------------

    def _holding(self, entry: AdapterEntry) -> ControlResult:
        """An idempotent load's result: each rank succeeded if it holds the current version."""
        if entry.standby:
            return replace(self._standby_result(), already_loaded=True)
        return self.registry.public_result(self.engine.holding(entry.engine_name))

    def _standby_result(self) -> ControlResult:
        """A standby load's or unload's result: no rank was asked; each answers with what it holds."""
        try:
            holdings = self.engine.holdings()
        except BackendError as error:
            raise self._engine_error(error) from None
        places = {place.rank: place for place in self.backend.ranks}
        replies = []
        for ranks in holdings:
            place = places[ranks.rank]
            replies.append(
                ControlReply(place.rank, place.attn_dp_rank, place.attn_tp_rank, True, holds=self.registry.public_names(ranks.holds))
            )
        return merge_control(replies)


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
