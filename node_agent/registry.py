"""The agent's adapter registry: public names, the engine names behind them, and who is using them.

A public name (what callers and the operator use) maps to one *engine name*, fresh for every
load (`<name>.<generation>`), so a replacement can be loaded beside the version it replaces and
swapped in at once. Requests take a lease on the engine names they use for their whole duration
(a Generate stream included); retiring a version (replace or unload) first stops routing to it,
then waits, bounded, for its leases to drain, and only then is it unloaded from the ranks.

Calls for the same name are serialised (`serialised`); different names proceed concurrently,
so a slow download or drain of one adapter never blocks another (the engine itself still runs
one command at a time).

A routable version is resident (the engine holds it under its engine name) or on standby (its
verified snapshot is kept, the engine does not hold it): leasing a standby version is refused
with `OnStandby`, and the agent loads it (`node_agent.residency`) before it leases again.

Every load onto the backend first reserves a place (`reserve_place`, or `to_standby`, which turns
an evicted version's place into the evicting load's reservation), and a place counts as taken
while it is held or reserved, so two loads never count on the same free place.

Everything here is in-process bookkeeping; the engine is driven by `node_agent.agent`.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from node_agent.backend import ControlResult
from node_agent.errors import AdapterNotFound
from node_agent.sources import ResolvedSource


@dataclass(frozen=True)
class AdapterEntry:
    """One loaded version of an adapter."""

    name: str
    engine_name: str
    source: ResolvedSource
    pinned: bool
    standby: bool = False  # routable, but the engine does not hold it: loaded by its first request

    def is_exactly(self, uri: str, sha256: str | None, pinned: bool) -> bool:
        """A load names exactly this version (same URI, promised digest and pinning): no fetch."""
        return sha256 is not None and self.source.uri == uri and self.source.content.weights_sha256 == sha256 and self.pinned == pinned

    def conflict(self, new_sha256: str, pinned: bool) -> str:
        """Why a load of other content or pinning under this name needs `replace`."""
        if self.source.content.weights_sha256 == new_sha256 and self.pinned != pinned:
            return f"adapter {self.name!r} is loaded with pinned={self.pinned}; set replace to change it"
        return (
            f"adapter {self.name!r} is loaded with other content (sha256 {self.source.content.weights_sha256}, "
            f"new {new_sha256}); set replace to swap it"
        )


class OnStandby(Exception):
    """A lease named adapters whose current versions are on standby (`names`); nothing was leased."""

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__(f"adapters on standby: {', '.join(names)}")
        self.names = names


@dataclass(frozen=True)
class ResidentUse:
    """A resident version as eviction sees it: its requests now and when it was last leased."""

    entry: AdapterEntry
    in_flight: int
    last_used: float  # time.monotonic() of its last lease (its load, if never leased)


@dataclass(eq=False)
class PlaceReservation:
    """A backend place held for one load, from when it was free (or freed by an eviction) until
    the load publishes its version (`Registry.publish`) or gives up (`Registry.release_place`)."""

    open: bool = True


@dataclass
class Lease:
    """A request's hold on the adapter versions it uses (public name -> engine name)."""

    engine_names: dict[str, str]
    released: bool = field(default=False, compare=False)

    def engine_name(self, name: str | None) -> str | None:
        return None if name is None else self.engine_names[name]


@dataclass
class _NameLock:
    """The lock of one public name and how many calls use (or wait for) it."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    users: int = 0


class Registry:
    """Routable adapters, versions being retired, leases, and per-name serialisation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._routable: dict[str, AdapterEntry] = {}  # public name -> current version
        self._held: dict[str, AdapterEntry] = {}  # engine name -> version the engine holds
        self._public_of: dict[str, str] = {}  # engine name -> public name, for `_held`'s versions
        self._retiring: set[str] = set()  # public names being unloaded (refused with a clear message)
        self._leases: Counter[str] = Counter()  # engine name -> running requests
        self._revoked: set[str] = set()  # engine names unloaded while still leased
        self._name_locks: dict[str, _NameLock] = {}  # public name -> its lock while someone uses it
        self._last_used: dict[str, float] = {}  # public name -> time.monotonic() of its last lease or load
        self._reserved = 0  # places reserved by loads not yet published (open PlaceReservations)
        self._generation = itertools.count(1)

    # -- per-name serialisation ------------------------------------------------------------------

    @contextmanager
    def serialised(self, name: str) -> Iterator[None]:
        """Hold the lock of one public name; the lock is dropped when nobody uses it."""
        with self._lock:
            slot = self._name_locks.setdefault(name, _NameLock())
            slot.users += 1
        try:
            with slot.lock:
                yield
        finally:
            with self._lock:
                slot.users -= 1
                if slot.users == 0:
                    del self._name_locks[name]

    @contextmanager
    def try_serialised(self, name: str) -> Iterator[bool]:
        """Hold the lock of one public name if it is free now (yields True), else yield False."""
        with self._lock:
            slot = self._name_locks.setdefault(name, _NameLock())
            slot.users += 1
        taken = slot.lock.acquire(blocking=False)
        try:
            yield taken
        finally:
            if taken:
                slot.lock.release()
            with self._lock:
                slot.users -= 1
                if slot.users == 0:
                    del self._name_locks[name]

    # -- versions ----------------------------------------------------------------------------------

    def new_engine_name(self, name: str) -> str:
        """A fresh engine name for a new version of `name` (itself valid under `ADAPTER_NAME`)."""
        return f"{name[:240]}.{next(self._generation)}"

    def get(self, name: str) -> AdapterEntry | None:
        with self._lock:
            return self._routable.get(name)

    def entries(self) -> list[AdapterEntry]:
        """Routable adapters, in load order."""
        with self._lock:
            return list(self._routable.values())

    def held(self) -> list[AdapterEntry]:
        """Every version the engine holds: routable ones and ones being retired."""
        with self._lock:
            return list(self._held.values())

    def public_name(self, engine_name: str) -> str:
        """The public name of an engine name (itself if the registry does not know it)."""
        with self._lock:
            return self._public_of.get(engine_name, engine_name)

    def public_names(self, engine_names: Iterable[str]) -> tuple[str, ...]:
        """`public_name` of each engine name, in order, each public name once (two versions of
        one adapter are one name), under one lock. Every load and unload reply maps all a rank
        holds, a thousand names at a time: one dict lookup each, with no Python frame."""
        names = tuple(engine_names)
        with self._lock:
            return tuple(dict.fromkeys(map(self._public_of.get, names, names)))

    def adapter_name(self, engine_name: str) -> str:
        """The public name of an engine name, also of a version already forgotten."""
        name = self.public_name(engine_name)
        return public_of(engine_name) if name == engine_name else name

    def public_result(self, result: ControlResult) -> ControlResult:
        """`result` with public adapter names instead of engine names (versions of one name once)."""
        # Every reply lists all a rank holds, and the ranks mostly hold the same: each distinct
        # holding is mapped once (compared, not hashed), not ranks x held lookups per reply.
        mapped: list[tuple[tuple[str, ...], tuple[str, ...]]] = []

        def public(names: tuple[str, ...]) -> tuple[str, ...]:
            for engine_names, public_names in mapped:
                if engine_names == names:
                    return public_names
            mapped.append((names, self.public_names(names)))
            return mapped[-1][1]

        ranks = tuple(replace(reply, holds=public(reply.holds)) for reply in result.ranks)
        return replace(result, holds=public(result.holds), ranks=ranks)

    def publish(self, entry: AdapterEntry, place: PlaceReservation | None = None) -> AdapterEntry | None:
        """Route `entry.name` to `entry` from now on; returns the version it replaces, if any.
        `place`: the reservation its load took, now the place it holds."""
        with self._lock:
            if place is not None:
                self._close(place)
            previous = self._routable.get(entry.name)
            self._routable[entry.name] = entry
            self._last_used[entry.name] = time.monotonic()
            if not entry.standby:
                self._held[entry.engine_name] = entry
                self._public_of[entry.engine_name] = entry.name
            return previous

    def update(self, entry: AdapterEntry) -> None:
        """Change a routable version's metadata (same engine name, e.g. the source URI)."""
        with self._lock:
            current = self._routable.get(entry.name)
            if current is not None and current.engine_name == entry.engine_name:
                self._routable[entry.name] = entry
                self._held[entry.engine_name] = entry

    def withdraw(self, name: str) -> AdapterEntry:
        """Stop routing `name` at once (new requests are refused); returns its version."""
        with self._lock:
            entry = self._routable.pop(name, None)
            if entry is None:
                raise AdapterNotFound(f"adapter {name!r} is not loaded")
            self._retiring.add(name)
            self._last_used.pop(name, None)
            return entry

    def forget(self, entry: AdapterEntry) -> None:
        """The engine no longer holds `entry`; requests still leasing it are revoked."""
        with self._lock:
            self._held.pop(entry.engine_name, None)
            self._public_of.pop(entry.engine_name, None)
            if entry.name not in self._routable:
                self._retiring.discard(entry.name)
            if self._leases[entry.engine_name]:
                self._revoked.add(entry.engine_name)

    # -- residency -------------------------------------------------------------------------------

    def resident_uses(self) -> list[ResidentUse]:
        """Every routable resident version with its requests now and its last use."""
        with self._lock:
            return [
                ResidentUse(entry, self._leases[entry.engine_name], self._last_used.get(entry.name, 0.0))
                for entry in self._routable.values()
                if not entry.standby
            ]

    def to_standby(self, entry: AdapterEntry) -> PlaceReservation | None:
        """Put a resident version on standby if it is still current and no request leases it
        (then new requests find it on standby at once); None if it is not. Its place becomes the
        caller's reservation at once (the caller unloads it, then loads into that place)."""
        with self._lock:
            if self._routable.get(entry.name) is not entry or self._leases[entry.engine_name]:
                return None
            self._routable[entry.name] = replace(entry, standby=True)
            self._held.pop(entry.engine_name, None)
            self._public_of.pop(entry.engine_name, None)
            self._reserved += 1
            return PlaceReservation()

    def reserve_place(self, capacity: int, in_place_of: AdapterEntry | None = None) -> PlaceReservation | None:
        """Reserve one of the backend's `capacity` places for a load if one is neither held nor
        reserved; None if every one is. `in_place_of`: a version the load replaces in place (a
        backend that `replaces_in_place`): while it is held its place is the load's, nothing more
        is reserved."""
        with self._lock:
            if in_place_of is not None and in_place_of.engine_name in self._held:
                return PlaceReservation(open=False)
            if len(self._held) + self._reserved >= capacity:
                return None
            self._reserved += 1
            return PlaceReservation()

    def release_place(self, place: PlaceReservation) -> None:
        """Give back the place of a load that published nothing (nothing to do once published)."""
        with self._lock:
            self._close(place)
            self._idle.notify_all()  # a load waiting for room looks again

    @contextmanager
    def place_given_back_on_failure(self, place: PlaceReservation) -> Iterator[None]:
        """Give `place` back if the block fails (its load put nothing on the backend)."""
        try:
            yield
        except BaseException:
            self.release_place(place)
            raise

    def _close(self, place: PlaceReservation) -> None:
        if place.open:
            place.open = False
            self._reserved -= 1

    def wait_change(self, timeout_s: float) -> None:
        """Wait until a lease or a place is released (a version may have become idle, a place
        free), at most `timeout_s`."""
        with self._lock:
            self._idle.wait(max(timeout_s, 0.0))

    # -- leases ----------------------------------------------------------------------------------

    def acquire(self, names: Iterable[str]) -> Lease:
        """Lease the current version of each name; unknown or retiring names are refused."""
        with self._lock:
            mapping = {}
            standby = []
            for name in dict.fromkeys(names):
                entry = self._routable.get(name)
                if entry is None:
                    state = "is being unloaded" if name in self._retiring else "is not loaded"
                    raise AdapterNotFound(f"adapter {name!r} {state}")
                if entry.standby:
                    standby.append(name)
                mapping[name] = entry.engine_name
            if standby:
                raise OnStandby(tuple(standby))
            now = time.monotonic()
            for name, engine_name in mapping.items():
                self._leases[engine_name] += 1
                self._last_used[name] = now
            return Lease(mapping)

    def release(self, lease: Lease) -> None:
        with self._lock:
            if lease.released:
                return
            lease.released = True
            for engine_name in lease.engine_names.values():
                self._leases[engine_name] -= 1
                if not self._leases[engine_name]:
                    del self._leases[engine_name]
                    self._revoked.discard(engine_name)
            self._idle.notify_all()

    def revoked(self, lease: Lease) -> list[str]:
        """Public names of the lease whose versions were unloaded under it."""
        with self._lock:
            return [name for name, engine_name in lease.engine_names.items() if engine_name in self._revoked]

    def in_flight(self, engine_name: str) -> int:
        with self._lock:
            return self._leases[engine_name]

    def wait_idle(self, engine_name: str, timeout_s: float) -> bool:
        """Wait until no request leases `engine_name`; False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._leases[engine_name]:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
            return True


def public_of(engine_name: str) -> str:
    """The public name inside an engine name (`<name>.<generation>`, `Registry.new_engine_name`)."""
    return engine_name.rsplit(".", 1)[0]
