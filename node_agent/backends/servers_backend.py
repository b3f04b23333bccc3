"""Several stock inference servers behind the agent's seam, each server a rank of the per-rank
replies (docs/vllm.md).

A load is validated by the agent before any server is asked, then sent to every server at once,
all or none: a server that refused leaves the others to drop it again (or, for a replace, to load
the previous version back in place). Each server holds an adapter under its public name (what
gateways ask it for), so a new version replaces the old one in place; the version it replaced is
superseded and its later unload asks no server. The truth is each server's model list: an adapter
is held where the server lists it, from the path of its current version.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from node_agent.backend import (
    AdapterRefused,
    AdapterRequests,
    BackendDescription,
    BackendError,
    Capabilities,
    Capacity,
    ControlReply,
    ControlResult,
    Health,
    LoadFailed,
    LoadRequest,
    RankHoldings,
    RankLayout,
    RankPlace,
    RunningCommand,
    Sampling,
    SequenceInput,
    ServingStats,
    SnapshotChanged,
    UnloadFailed,
    Unsupported,
    WrittenFiles,
    all_or_nothing,
    already_loaded,
    merge_control,
)
from node_agent.backend.files import FileIdentity
from node_agent.backends.server import CompletionStep, InferenceServer, Refusal, ServerModels
from node_agent.backends.server_demand import adapter_counts
from node_agent.backends.stream import ServerStream, refusal_error

T = TypeVar("T")

#: Checks an adapter directory against the base model before any server is asked; raises
#: `ValueError` saying why it is refused.
Validator = Callable[[Path], object]


@dataclass(frozen=True)
class ServersConfig:
    """What the servers are: their kind, the base model's directory (on the volume the agent
    shares with them) and the capacity they were started with."""

    kind: str  # "vllm"
    model_dir: Path
    capacity: Capacity


@dataclass(frozen=True)
class Version:
    """The version of an adapter the servers hold under its public name: the agent's name of
    it and the snapshot they read."""

    engine_name: str
    path: str


def served_name(engine_name: str) -> str:
    """The name a server holds a version under: its public name (the agent names versions
    `<name>.<generation>`, `Registry.new_engine_name`)."""
    return engine_name.rsplit(".", 1)[0]


class ServersBackend:
    """Stock inference servers as a `Backend`: loads, unloads, listings and Generate; no Forward
    and no pinning (`Unsupported`)."""

    def __init__(self, servers: Sequence[InferenceServer], config: ServersConfig, validate: Validator) -> None:
        if not servers:
            raise ValueError("a backend over servers needs at least one server")
        self._servers = tuple(servers)
        self._config = config
        self._validate = validate
        self._places = tuple(RankPlace(rank, rank, 0) for rank in range(len(servers)))
        self._pool = ThreadPoolExecutor(len(servers), thread_name_prefix="servers")
        # Metrics reads never wait behind a load that holds every thread of the pool.
        self._metrics_pool = ThreadPoolExecutor(len(servers), thread_name_prefix="servers-metrics")
        self._command = threading.Lock()  # one load or unload at a time, as the engine's command lock
        self._state = threading.Lock()  # guards what follows
        self._versions: dict[str, Version] = {}  # served name -> its current version
        self._superseded: set[str] = set()  # versions replaced in place, not yet unloaded by the agent
        self._answered = [True] * len(servers)  # whether each server answered its last call
        self._bases: list[str | None] = [None] * len(servers)
        self._held: list[frozenset[str]] = [frozenset()] * len(servers)  # what each server listed last
        self._running: RunningCommand | None = None
        self._streams: dict[int, tuple[int, str | None]] = {}  # open streams: id -> (server's rank, adapter)
        self._answering: set[int] = set()  # open streams whose first token arrived
        self._stream_ids = itertools.count()
        self._round_robin = itertools.count()
        self._closed = False

    @property
    def servers(self) -> tuple[str, ...]:
        """Every server's URL, rank order."""
        return tuple(server.url for server in self._servers)

    def describe(self) -> BackendDescription:
        """Each server a DP rank of one, served at its URL; the capacity the servers were started
        with."""
        versions = sorted(set(self._each(lambda server: server.version())))
        count = len(self._servers)
        return BackendDescription(
            kind=self._config.kind,
            version=", ".join(versions),
            model_dir=self._config.model_dir,
            vocab_size=_vocab_size(self._config.model_dir),
            layout=RankLayout(count, count, 1, 1, 1, False),
            ranks=self._places,
            capacity=self._config.capacity,
            capabilities=Capabilities(forward=False, generate=True, pinning=False, replaces_in_place=True),
            endpoints=self.servers,
        )

    # -- loads and unloads ---------------------------------------------------------------------

    def load(self, request: LoadRequest) -> ControlResult:
        """Validate, then load on every server or on none (`all_or_nothing`)."""
        if request.pinned:
            raise Unsupported(f"{self._config.kind} servers cannot pin an adapter: their HTTP API has no device slot to keep")
        if request.written is not None:
            _check_unchanged(request.path, request.written)
        try:
            self._validate(request.path)
        except ValueError as error:
            raise AdapterRefused(str(error)) from None
        served, path = served_name(request.name), str(request.path)
        with self._command, self._running_command("load", request.name):
            with self._state:
                previous = self._versions.get(served)
                self._versions[served] = Version(request.name, path)
            taken = [False] * len(self._servers)

            def load() -> list[ControlReply]:
                return self._each_rank(lambda rank, server: self._load_on(rank, server, served, path, taken))

            def undo() -> list[ControlReply]:
                with self._state:  # the servers' listings after the rollback name the previous version again
                    self._restore(served, previous)
                return self._each_rank(lambda rank, server: self._undo_on(rank, server, served, previous, taken[rank]))

            result = all_or_nothing(load, undo)
            with self._state:
                if not result.ok:
                    self._restore(served, previous)
                elif previous is not None:
                    self._superseded.add(previous.engine_name)
        if not result.ok:
            raise LoadFailed(result)
        return result

    def unload(self, name: str) -> ControlResult:
        """Unload from every server (a server that no longer lists it counts as done); the
        unload of a version superseded by a replace asks no server."""
        with self._command, self._running_command("unload", name):
            with self._state:
                served = served_name(name)
                current = self._versions.get(served)
                superseded = name in self._superseded
                self._superseded.discard(name)
                if not superseded and (current is None or current.engine_name != name):
                    raise BackendError(f"adapter {name!r} is not loaded")
                if not superseded:
                    del self._versions[served]
            if superseded:
                return merge_control(self._each_rank(lambda rank, server: self._reply(rank, server, None)))
            result = merge_control(self._each_rank(lambda rank, server: self._unload_on(rank, server, served)))
        if not result.ok:
            raise UnloadFailed(result)
        return result

    def holding(self, name: str) -> ControlResult:
        """A load of the current version again: a server that lost it (restarted) loads it from
        its snapshot first, so the operator's drift repair restores it; then what each holds."""
        with self._command, self._running_command("load", name):
            with self._state:
                current = self._versions.get(served_name(name))
            reloads: dict[int, ControlReply] = {}
            if current is not None and current.engine_name == name:
                taken, lost = [False] * len(self._servers), [rank for rank in range(len(self._servers)) if name not in self._holds(rank)]
                reloaded = self._pool.map(
                    lambda rank: self._load_on(rank, self._servers[rank], served_name(name), current.path, taken), lost
                )
                reloads = {reply.rank: reply for reply in reloaded if not reply.ok}
            held = already_loaded(name, [(self._places[h.rank], h.holds) for h in self.holdings()])
            # A server that could not take it back answers in its own words (down: transient).
            return merge_control([reloads.get(r.rank, r) if not r.ok else r for r in held.ranks], already_loaded=True)

    def holdings(self) -> list[RankHoldings]:
        """What each server lists now, as the agent's names of the versions (a server that does
        not answer holds nothing)."""
        return [RankHoldings(rank, holds) for rank, holds in enumerate(self._pool.map(self._holds, range(len(self._servers))))]

    def _load_on(self, rank: int, server: InferenceServer, served: str, path: str, taken: list[bool]) -> ControlReply:
        listed = self._models(rank, server)
        if isinstance(listed, Refusal):
            return self._refused(rank, server, "the load", listed)
        full = self._at_capacity(listed, served)
        if full is not None:
            return self._refused(rank, server, "the load", full)
        refusal = server.load(served, path)
        taken[rank] = refusal is None
        return self._reply(rank, server, refusal)

    def _undo_on(self, rank: int, server: InferenceServer, served: str, previous: Version | None, taken: bool) -> ControlReply:
        if taken:
            # A replace goes back to the previous version (whose snapshot the agent still has).
            refusal = server.unload(served) if previous is None else server.load(served, previous.path)
            if refusal is not None:
                return self._refused(rank, server, "the rollback", refusal)
        return self._reply(rank, server, None)

    def _unload_on(self, rank: int, server: InferenceServer, served: str) -> ControlReply:
        refusal = server.unload(served)
        if refusal is not None and refusal.status == 404:
            refusal = None  # the server had lost it (restarted): gone either way
        return self._reply(rank, server, refusal)

    def _at_capacity(self, listed: ServerModels, served: str) -> Refusal | None:
        limit = self._config.capacity.max_loaded_loras
        held = [name for name, _ in listed.adapters if name != served]
        if len(held) < limit:
            return None
        return Refusal(0, "AtCapacity", f"the server holds {len(held)} adapters, the most --max-loaded-loras allows ({limit})", True)

    def _reply(self, rank: int, server: InferenceServer, refusal: Refusal | None) -> ControlReply:
        """A rank's reply to a command, with what the server lists afterwards."""
        if refusal is not None:
            return self._refused(rank, server, "the command", refusal)
        place = self._places[rank]
        return ControlReply(rank, place.attn_dp_rank, place.attn_tp_rank, True, holds=self._holds(rank))

    def _refused(self, rank: int, server: InferenceServer, what: str, refusal: Refusal) -> ControlReply:
        place = self._places[rank]
        error = f"server {rank} ({server.url}) refused {what}: {refusal.describe()}"
        return ControlReply(
            rank, place.attn_dp_rank, place.attn_tp_rank, False, error, transient=not refusal.permanent, holds=self._holds(rank)
        )

    def _restore(self, served: str, previous: Version | None) -> None:
        if previous is None:
            self._versions.pop(served, None)
        else:
            self._versions[served] = previous

    # -- what the servers hold -----------------------------------------------------------------

    def _models(self, rank: int, server: InferenceServer) -> ServerModels | Refusal:
        listed = server.models()
        with self._state:
            self._answered[rank] = not isinstance(listed, Refusal)
            if not isinstance(listed, Refusal):
                self._bases[rank] = listed.base
        return listed

    def _holds(self, rank: int) -> tuple[str, ...]:
        listed = self._models(rank, self._servers[rank])
        if isinstance(listed, Refusal):
            return ()
        with self._state:
            holds = tuple(
                version.engine_name
                for name, path in listed.adapters
                if (version := self._versions.get(name)) is not None and version.path == path
            )
            self._held[rank] = frozenset(holds)
        return holds

    # -- serving -------------------------------------------------------------------------------

    def forward(self, sequences: Sequence[SequenceInput]) -> list[np.ndarray]:
        raise Unsupported(f"{self._config.kind} servers return no prompt logits: Forward is not served (use Generate)")

    def generate(self, tokens: Sequence[int], adapter: str | None, sampling: Sampling) -> ServerStream:
        """Stream from a server that holds `adapter` (any server for the base model), in turn; a
        server that answers it does not know the adapter (it restarted) passes to the next."""
        model = self._model_of(adapter)
        candidates = self._candidates(adapter)
        for rank in candidates:
            steps = self._complete(rank, model, tokens, sampling)
            if not isinstance(steps, Refusal):
                return self._stream(rank, adapter, steps)
            if steps.status != 404 or model is None or rank == candidates[-1]:
                raise refusal_error(self._servers[rank], steps)
            with self._state:
                self._held[rank] = frozenset(name for name in self._held[rank] if name != adapter)
        raise BackendError("no server to send the request to")  # unreachable: every server is a candidate

    def _complete(self, rank: int, model: str | None, tokens: Sequence[int], sampling: Sampling) -> Iterator[CompletionStep] | Refusal:
        """One server's stream of `model`'s completion (None: the base model, by the id it lists)."""
        server = self._servers[rank]
        if model is None:
            model = self._bases[rank]
        if model is None:
            listed = self._models(rank, server)
            if isinstance(listed, Refusal):
                return listed
            model = listed.base
        return server.complete(model, tokens, sampling)

    def _model_of(self, adapter: str | None) -> str | None:
        if adapter is None:
            return None
        with self._state:
            version = self._versions.get(served_name(adapter))
            # A request that leased a version just replaced in place is served by its successor.
            if version is None or (version.engine_name != adapter and adapter not in self._superseded):
                raise BackendError(f"adapter {adapter!r} is not loaded")
        return served_name(adapter)

    def _candidates(self, adapter: str | None) -> list[int]:
        """The servers to try, from the next in turn: those that answered their last call and,
        for an adapter, listed it last (the others after them, in case they have it since)."""
        with self._state:
            answered = [rank for rank, ok in enumerate(self._answered) if ok]
            holding = [rank for rank in answered if adapter is None or adapter in self._held[rank]]
        start = next(self._round_robin)
        first = holding or answered
        first = first[start % len(first) :] + first[: start % len(first)] if first else []
        return first + [rank for rank in range(len(self._servers)) if rank not in first]

    def _stream(self, rank: int, adapter: str | None, steps: Iterator[CompletionStep]) -> ServerStream:
        stream_id = next(self._stream_ids)
        with self._state:
            self._streams[stream_id] = (rank, adapter)
        observed = _FirstStep(steps, lambda: self._stream_answering(stream_id))
        return ServerStream(observed, f"server {rank} ({self._servers[rank].url})", lambda: self._stream_ended(stream_id))

    def _stream_answering(self, stream_id: int) -> None:
        with self._state:
            if stream_id in self._streams:
                self._answering.add(stream_id)

    def _stream_ended(self, stream_id: int) -> None:
        with self._state:
            self._streams.pop(stream_id, None)
            self._answering.discard(stream_id)

    # -- health --------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """While not closed: a server that restarts is a rank that lost its adapters, not the
        agent's end (ListAdapters shows what it lost; the operator reloads it)."""
        return not self._closed

    def health(self) -> Health:
        """From each server's last answer (asks none)."""
        with self._state:
            answered = tuple(self._answered)
            running = self._running
        return Health(not self._closed, "" if not self._closed else "closed", running, answered)

    def serving_stats(self) -> ServingStats:
        """The streams this agent has open (the servers' own queues are on their /metrics)."""
        with self._state:
            adapters = frozenset(adapter for _, adapter in self._streams.values() if adapter is not None)
            return ServingStats(0, 0, 0, (), len(self._streams), 0, adapters, frozenset())

    def adapter_requests(self) -> tuple[AdapterRequests, ...]:
        """Every client's requests per adapter (`server_demand`): the agent's own open streams
        (running once the server sent their first token, waiting before) completed by each
        server's own metrics (`InferenceServer.requests`), so requests other clients sent the
        servers count too; a server whose metrics do not answer counts the agent's streams only."""
        reports = list(self._metrics_pool.map(lambda server: server.requests(), self._servers))
        with self._state:
            streams = [(stream_id in self._answering, rank, adapter) for stream_id, (rank, adapter) in self._streams.items()]
            engine_names = {served: version.engine_name for served, version in self._versions.items()}
        running: Counter[str | None] = Counter()
        waiting: Counter[str | None] = Counter()
        for rank, report in enumerate(reports):
            own_running = Counter(adapter for answering, at, adapter in streams if at == rank and answering)
            own_waiting = Counter(adapter for answering, at, adapter in streams if at == rank and not answering)
            if isinstance(report, Refusal):
                running.update(own_running)
                waiting.update(own_waiting)
                continue
            running.update(adapter_counts(own_running, report.running, _known(report.running_adapters, engine_names)))
            waiting.update(adapter_counts(own_waiting, report.waiting, _known(report.waiting_adapters, engine_names)))
        return tuple(AdapterRequests(adapter, running[adapter], waiting[adapter]) for adapter in running | waiting)

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._metrics_pool.shutdown(wait=False, cancel_futures=True)

    # -- helpers -------------------------------------------------------------------------------

    def _each(self, call: Callable[[InferenceServer], T]) -> list[T]:
        """`call` on every server at once, rank order."""
        return list(self._pool.map(call, self._servers))

    def _each_rank(self, call: Callable[[int, InferenceServer], ControlReply]) -> list[ControlReply]:
        return list(self._pool.map(call, range(len(self._servers)), self._servers))

    @contextmanager
    def _running_command(self, command: str, adapter: str) -> Iterator[None]:
        """Marks the command as running while its block runs (health's hang detection)."""
        with self._state:
            self._running = RunningCommand(command, adapter, time.monotonic())
        try:
            yield
        finally:
            with self._state:
                self._running = None


class _FirstStep:
    """A server's steps, telling `answering` when the first one arrives; closing it closes them."""

    def __init__(self, steps: Iterator[CompletionStep], answering: Callable[[], None]) -> None:
        self._steps = steps
        self._answering: Callable[[], None] | None = answering

    def __iter__(self) -> _FirstStep:
        return self

    def __next__(self) -> CompletionStep:
        step = next(self._steps)
        if self._answering is not None:
            self._answering()
            self._answering = None
        return step

    def close(self) -> None:
        close = getattr(self._steps, "close", None)
        if close is not None:
            close()


def _known(served: frozenset[str], engine_names: dict[str, str]) -> list[str]:
    """The backend names of the adapters a server named that the agent loaded (others' loads
    are not its adapters)."""
    return [engine_names[name] for name in served if name in engine_names]


def _check_unchanged(path: Path, written: WrittenFiles) -> None:
    """The snapshot's files are still those the agent verified (the servers read them later)."""
    for name, identity in (("adapter_model.safetensors", written.weights), ("adapter_config.json", written.config)):
        try:
            now = FileIdentity.of((path / name).stat())
        except OSError as error:
            raise SnapshotChanged(f"{name} of the verified snapshot is gone: {error}") from None
        if now != identity:
            raise SnapshotChanged(f"{name} changed after it was verified")


def _vocab_size(model_dir: Path) -> int:
    """The base model's vocabulary size from its config.json (a text config nested or not)."""
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("vocab_size") or config.get("text_config", {})["vocab_size"])
