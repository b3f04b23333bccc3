"""Standby adapters and their load on first request: the one rule (docs/agent.md, Standby).

A standby adapter is routable but not held by the backend: its verified snapshot is kept on
disk (and in host memory where the budget allows). The first inference request that names it
loads it (`OnDemand.lease`):

* one load per adapter at a time: concurrent requests for it wait on the same load;
* at most `max_concurrent` on-demand loads at once (`--max-concurrent-adapter-loads`);
* when the backend holds `capacity` adapters already, the least recently used resident adapter
  that is not pinned and serves no request is put back on standby (its snapshot kept) first; a
  pinned one, one with requests in flight, or one a request waits to lease (a load just
  published, before its waiters take it) never is;
* a load takes its place in one step with making room: a free place is reserved, or an evicted
  adapter's place becomes the load's reservation as it leaves the registry, and the reservation
  is held until the load publishes or fails (`Registry.reserve_place`). Every load counts places
  held *or reserved*, the operator's LoadAdapter too (refused at once when all are), so no load
  finds the place it made taken by another. (Retrying the eviction after the backend refused
  would not do: each retry evicts one more adapter, and two loads can keep taking each other's
  place until the deadline);
* every waiting request gives up at its deadline (`--adapter-load-deadline-s`, counted from when
  it began to wait): UNAVAILABLE naming the deadline, or RESOURCE_EXHAUSTED when the wait was
  for an adapter that could be evicted and none could.

A standby LoadAdapter of a resident adapter's content (the operator's scale-down) puts it back
on standby in place (`OnDemand.demote`) and never waits for it: idle now, it goes on standby at
once, as an eviction does, its place freed; leased, the load answers resident and the switch is
left to one background worker, made as soon as no request leases that version (it stays
routable and resident meanwhile, never unknown to the agent). A replace, an unload or a
resident LoadAdapter of the name meanwhile cancels it.

The backend is driven through the seam's own load and unload (`Backend.load`, `.unload`), so
the builtin engine and the vLLM servers serve it alike. A load reads the version's copy in host
memory when it has one, and an adapter evicted back to standby is offered to that tier
(`node_agent.standby_memory`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from node_agent.backend import (
    AdapterRefused,
    Backend,
    BackendError,
    ControlReply,
    ControlResult,
    LoadFailed,
    LoadRequest,
    RankPlace,
    UnloadFailed,
    merge_control,
)
from node_agent.errors import AgentError, CapacityExceeded, EngineUnavailable
from node_agent.registry import AdapterEntry, Lease, OnStandby, PlaceReservation, Registry, ResidentUse
from node_agent.standby_memory import SnapshotFiles, StandbyMemory, StandbyMemorySettings

log = logging.getLogger(__name__)

DEFAULT_MAX_CONCURRENT_LOADS = 2
DEFAULT_LOAD_DEADLINE_S = 60.0
_RECHECK_S = 0.25  # how often a load waiting for an evictable adapter looks again


@dataclass(frozen=True)
class OnDemandSettings:
    """How standby adapters are loaded on first request (serve flags)."""

    max_concurrent: int = DEFAULT_MAX_CONCURRENT_LOADS  # --max-concurrent-adapter-loads
    deadline_s: float = DEFAULT_LOAD_DEADLINE_S  # --adapter-load-deadline-s
    memory: StandbyMemorySettings = field(default_factory=StandbyMemorySettings)  # standby snapshots in host memory


class _Gone(Exception):
    """The adapter's load ended without making it resident for a reason worth another look
    (another load's deadline, the adapter replaced or evicted meanwhile)."""


class _NoRoom(Exception):
    """No resident adapter could be evicted before the deadline."""


def eviction_victim(uses: Sequence[ResidentUse], keep: frozenset[str]) -> AdapterEntry | None:
    """The resident version to put on standby to make room: the least recently used one that is
    not pinned, serves no request and is not in `keep` (being loaded, or wanted by a request that
    has not leased it yet); None if there is none."""
    idle = [use for use in uses if not use.entry.pinned and use.in_flight == 0 and use.entry.name not in keep]
    return min(idle, key=lambda use: use.last_used).entry if idle else None


class OnDemand:
    """Loads standby adapters for the requests that name them (the module docstring's rule)."""

    def __init__(
        self, backend: Backend, registry: Registry, capacity: int, settings: OnDemandSettings, observe_load: Callable[[float], None]
    ) -> None:
        self._backend = backend
        self._observe_load = observe_load  # each load's seconds (vllm:lora_adapter_load_seconds)
        self._registry = registry
        self._capacity = capacity
        self._settings = settings
        # The loads run on their own threads, at most `max_concurrent` at once, so that every
        # request waiting for one (the one that started it too) gives up at its own deadline.
        self._loads = ThreadPoolExecutor(settings.max_concurrent, thread_name_prefix="on-demand-load")
        self._lock = threading.Lock()
        self._loading: dict[str, Future[None]] = {}  # public name -> its load, queued or running
        # public name -> requests that want it and have not leased it yet: a load just published
        # is idle until its waiters lease it, and must not be evicted in that moment
        self._wanted: Counter[str] = Counter()
        self._no_room: set[str] = set()  # loads waiting for an adapter that can be evicted
        self._demoting: dict[str, AdapterEntry] = {}  # public name -> leased version a standby load put back on standby
        self._demoter: threading.Thread | None = None  # the worker of `_demoting`, while it is not empty
        self._closed = False
        self.memory = StandbyMemory(settings.memory)  # standby snapshots' copies in host memory

    def close(self) -> None:
        """Start no further load (a running one completes on its thread), drop the pending
        demotions (their worker stops at its next look); empty the memory tier."""
        with self._lock:
            self._closed = True
            self._demoting.clear()
        self._loads.shutdown(wait=False, cancel_futures=True)
        self.memory.close()

    def lease(self, names: Sequence[str]) -> Lease:
        """Lease the adapters' current versions, loading those on standby first (waiting, up to
        the deadline, for loads in flight and for room); `AdapterNotFound` for unknown names."""
        deadline = time.monotonic() + self._settings.deadline_s
        with self._wanting(names):
            while True:
                try:
                    return self._registry.acquire(names)
                except OnStandby as standby:
                    waiting = standby.names
                for name in waiting:
                    self._resident(name, deadline)

    @contextlib.contextmanager
    def _wanting(self, names: Sequence[str]) -> Iterator[None]:
        """While a request waits to lease `names`, none of them is evicted (a load's waiters
        lease it after it is published: evicting it in between made loads evict each other's
        adapters in turn, thousands of loads for a dozen requests)."""
        with self._lock:
            self._wanted.update(names)
        try:
            yield
        finally:
            with self._lock:
                self._wanted.subtract(names)
                self._wanted += Counter()  # drop the names no request wants any more

    def make_resident(self, entry: AdapterEntry) -> None:
        """Load a standby version now (a LoadAdapter that wants it resident; the caller holds its
        name's lock), evicting as a first request would."""
        try:
            self._load_entry(entry, time.monotonic() + self._settings.deadline_s)
        except _NoRoom:
            raise self._late(entry.name, starved=True) from None

    def _resident(self, name: str, deadline: float) -> None:
        """Make `name` resident: load it, or wait for its load in flight. Raises the deadline's
        refusal once it passed."""
        with self._lock:
            load = self._loading.get(name)
            started = load is None
            if load is None:
                load = self._loading[name] = self._loads.submit(self._load, name, deadline)
        if started:
            load.add_done_callback(lambda done: self._loaded(name, done))
        try:
            load.result(timeout=max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            with self._lock:
                starved = name in self._no_room
            raise self._late(name, starved=starved) from None
        except _Gone:
            if time.monotonic() >= deadline:
                raise self._late(name, starved=False) from None
        except _NoRoom:
            raise self._late(name, starved=True) from None

    def _loaded(self, name: str, load: Future[None]) -> None:
        with self._lock:
            if self._loading.get(name) is load:
                del self._loading[name]

    def _load(self, name: str, deadline: float) -> None:
        """Load `name` from its snapshot under a fresh engine name, after making room (on a load
        thread; every request waiting for it gets its outcome)."""
        if time.monotonic() >= deadline:
            raise _Gone()  # queued past the deadline of the request that asked: a later one asks again
        with self._registry.serialised(name):  # no operator load or unload of it meanwhile
            entry = self._registry.get(name)
            if entry is None or not entry.standby:
                return  # unloaded (the next lease says so) or resident already
            self._load_entry(entry, deadline)

    def _load_entry(self, entry: AdapterEntry, deadline: float) -> None:
        """Make room for `entry` and load it; its copy in host memory, if any, is held first, so
        that making room (the evicted adapter's copy) never pushes it out of memory."""
        with self.memory.loading(entry.source) as files:
            self._load_into(entry, files, self._take_place(entry.name, deadline))

    def _load_into(self, entry: AdapterEntry, files: SnapshotFiles, place: PlaceReservation) -> None:
        """Load `entry` from `files` into its reserved `place`; the place is given back if the load fails."""
        engine_name = self._registry.new_engine_name(entry.name)
        source = entry.source
        started = time.monotonic()
        try:
            self._backend.load(LoadRequest(engine_name, files.path, False, source.content, files.written))
            self._registry.publish(replace(entry, engine_name=engine_name, standby=False), place)
        except LoadFailed as error:
            raise _load_failed(entry.name, error.result.error) from None
        except (AdapterRefused, BackendError) as error:
            raise _load_failed(entry.name, str(error)) from None
        finally:
            self._registry.release_place(place)  # nothing to give back once published
        self._observe_load(time.monotonic() - started)
        log.info("adapter %s loaded on first request (engine name %s)", entry.name, engine_name)

    def _take_place(self, name: str, deadline: float) -> PlaceReservation:
        """Reserve a place for the load of `name`: a free one, else the place of an adapter it
        evicts; `_NoRoom` at the deadline."""
        try:
            while True:
                place = self._registry.reserve_place(self._capacity)
                if place is not None:
                    return place
                with self._lock:
                    keep = frozenset(self._loading) | frozenset(self._wanted) | {name}
                victim = eviction_victim(self._registry.resident_uses(), keep)
                place = None if victim is None else self._evict(victim)
                if place is not None:
                    return place
                if time.monotonic() >= deadline:
                    raise _NoRoom()
                with self._lock:
                    self._no_room.add(name)
                self._registry.wait_change(min(_RECHECK_S, deadline - time.monotonic()))
        finally:
            with self._lock:
                self._no_room.discard(name)

    def _evict(self, victim: AdapterEntry) -> PlaceReservation | None:
        """Put `victim` back on standby and unload it from the backend; its place is the caller's
        reservation. None if it is busy now."""
        with self._registry.try_serialised(victim.name) as free:
            place = self._registry.to_standby(victim) if free else None
            if place is None:
                return None
            with self._registry.place_given_back_on_failure(place):
                self._unload_to_standby(victim, "evicted: least recently used, idle")
            return place

    def settle(self, entry: AdapterEntry, *, standby: bool) -> AdapterEntry:
        """Where a LoadAdapter that found its content under the name leaves it (the caller holds
        its name's lock): resident now when it asked for a resident load (`make_resident`; a
        pending demotion of it is cancelled), back on standby in place when it asked for standby
        (`demote`). Returns the current version: still resident while its demotion is pending."""
        entry = self._registry.get(entry.name) or entry  # the caller may have updated its source's URI
        with self._lock:
            self._demoting.pop(entry.name, None)  # this load's wish replaces an earlier one's
        if entry.standby and not standby:
            self.make_resident(entry)
        elif standby and not entry.standby:
            self.demote(entry)
        return self._registry.get(entry.name) or entry

    def demote(self, entry: AdapterEntry) -> None:
        """Put a resident version back on standby in place (a standby LoadAdapter of its content:
        the operator's scale-down; the caller holds its name's lock). Idle now: it turns standby
        at once (the next request loads it again), is unloaded from the backend, its place freed
        and its snapshot kept. Leased: it stays routable and resident, and the demotion waits on
        the background worker (`_demote_when_idle`) without a deadline, since the operator never
        asks again and an adapter left resident would hold its place until evicted; the wait is
        cheap (one thread for every pending demotion, woken as leases end) and cancelled by a
        replace, an unload, a resident LoadAdapter of the name, or `close`. A pinned version never
        comes here: a standby load cannot be pinned, and one of other pinning is a conflict."""
        if self._to_standby(entry, "a standby load asked for it"):
            return
        log.info("adapter %s serves requests: it goes back on standby once none leases it (a standby load asked)", entry.name)
        with self._lock:
            if self._closed:
                return
            self._demoting[entry.name] = entry
            if self._demoter is None:
                self._demoter = threading.Thread(target=self._demote_when_idle, name="standby-demotion", daemon=True)
                self._demoter.start()

    def _demote_when_idle(self) -> None:
        """The background worker: look at every pending demotion whenever a lease or a place is
        released (and every `_RECHECK_S`, for a name whose lock was taken), until none is left."""
        while True:
            with self._lock:
                if self._closed or not self._demoting:
                    self._demoter = None
                    return
                pending = list(self._demoting.values())
            for entry in pending:
                if self._demotion_over(entry):
                    with self._lock:
                        if self._demoting.get(entry.name) is entry:
                            del self._demoting[entry.name]
            self._registry.wait_change(_RECHECK_S)

    def _demotion_over(self, entry: AdapterEntry) -> bool:
        """Try a pending demotion under its name's lock: True once made, or cancelled (the name no
        longer routes this very version); False while it is leased or its lock is taken."""
        if self._registry.get(entry.name) is not entry:
            log.info("adapter %s: its pending return to standby is cancelled (replaced, unloaded or loaded resident)", entry.name)
            return True
        with self._registry.try_serialised(entry.name) as free:
            try:
                return free and self._to_standby(entry, "a standby load asked for it; its requests have ended")
            except AgentError as error:
                log.error("%s", error)
                return True

    def _to_standby(self, entry: AdapterEntry, why: str) -> bool:
        """Put `entry` on standby and unload it if it is current and idle (the caller holds its
        name's lock), its place freed; False if it is not."""
        place = self._registry.to_standby(entry)
        if place is None:
            return False
        try:
            self._unload_to_standby(entry, why)
        finally:
            self._registry.release_place(place)
        return True

    def _unload_to_standby(self, entry: AdapterEntry, why: str) -> None:
        """Unload a version just put on standby (`Registry.to_standby`) from the backend and offer
        its snapshot to host memory; its place stays the caller's reservation."""
        try:
            self._backend.unload(entry.engine_name)
        except UnloadFailed as error:
            log.error("putting adapter %s back on standby: its unload failed on some ranks: %s", entry.name, error.result.error)
        except BackendError as error:
            raise EngineUnavailable(f"putting adapter {entry.name!r} back on standby failed: {error}") from None
        log.info("adapter %s put back on standby (%s)", entry.name, why)
        self.memory.offer(entry.source)  # into host memory, on the tier's thread (before any unload drops it)

    def _late(self, name: str, *, starved: bool) -> AgentError:
        """The refusal of a request whose deadline passed while `name` was not resident."""
        deadline = self._settings.deadline_s
        if starved:
            return CapacityExceeded(
                f"adapter {name!r} is on standby and could not be loaded within the {deadline:g}-s on-demand load deadline "
                f"(--adapter-load-deadline-s): all {self._capacity} places are held by adapters that are pinned or serving "
                "requests, or reserved by other loads, none could be evicted",
                reason="no_evictable_adapter",
            )
        return EngineUnavailable(
            f"adapter {name!r} is on standby and its on-demand load did not complete within the {deadline:g}-s deadline "
            "(--adapter-load-deadline-s); retry later",
            reason="load_deadline",
        )


def capacity_refusal(ranks: Sequence[RankPlace], registry: Registry, capacity: int) -> ControlResult:
    """A resident LoadAdapter refused before it reaches the ranks (so it never waits for a load
    running there) because every place is held or reserved by a load in progress: each rank
    refuses as the ranks refuse a load beyond their capacity, holding what the registry says."""
    error = f"max_loaded_loras ({capacity}) reached; unload an adapter first (every place is held, or reserved by a load in progress)"
    holds = tuple(dict.fromkeys(entry.name for entry in registry.held()))
    return merge_control([ControlReply(p.rank, p.attn_dp_rank, p.attn_tp_rank, False, error, holds=holds) for p in ranks])


def _load_failed(name: str, why: str) -> EngineUnavailable:
    return EngineUnavailable(f"the on-demand load of adapter {name!r} failed: {why}", reason="load_failed")
