"""Standby adapters' snapshots in host memory: the bounded tier beside the disk (docs/agent.md, Standby).

A standby adapter's verified snapshot is kept on disk (the agent's private copy). With a byte
budget (`--standby-memory-mib`) the agent also keeps a copy of its two files in a memory-backed
directory (`--standby-memory-dir`, a tmpfs), so that the load on its first request reads memory:

* when a version goes on standby (a standby LoadAdapter, or a resident adapter evicted back to
  standby) and its files fit in the budget, they are copied into the directory, hashed on the
  way and held to the digests its source verified: a mismatch (or a failed write) is logged as
  an error and the copy dropped, the disk copy stays;
* the copies least recently put on standby leave memory first to make room (their versions load
  from disk again); the copies together, those being written included, never exceed the budget;
* a copy a version was loaded from stays while that version is resident (a vLLM server reads
  the path again when it reloads an adapter) and may leave once the version is back on standby;
  a copy found changed when its load failed is dropped (the next load reads the disk copy);
* a version unloaded or replaced loses its copy; copies left by an earlier process are removed
  at start, as the download cache is.

A version keeps its disk snapshot while it goes between standby and resident, so copies are
known by the disk snapshot's path.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from lorafleet_common.sources import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from node_agent.backend import FileIdentity, WrittenFiles
from node_agent.sources import CHUNK_BYTES, HashedWriter, ResolvedSource

log = logging.getLogger(__name__)

DEFAULT_DIRECTORY = Path("/dev/shm/lorafleet-standby")
COPY_PREFIX = "mem-"
MIB = 1 << 20  # the unit of --standby-memory-mib


@dataclass(frozen=True)
class StandbyMemorySettings:
    """The tier's budget and directory (serve flags); a budget of 0 turns it off."""

    budget_bytes: int = 0  # --standby-memory-mib
    directory: Path = DEFAULT_DIRECTORY  # --standby-memory-dir

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0


@dataclass(frozen=True)
class SnapshotFiles:
    """Where a load reads a version's files, and the identities they had when they were hashed."""

    path: Path
    written: WrittenFiles | None


@dataclass(frozen=True)
class _Copy:
    files: SnapshotFiles
    size: int


class CopyMismatch(Exception):
    """The bytes copied into memory are not those the source verified."""


class StandbyMemory:
    """The host-memory copies of standby snapshots (the module docstring's rule); thread-safe."""

    def __init__(self, settings: StandbyMemorySettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._copies: OrderedDict[Path, _Copy] = OrderedDict()  # disk snapshot -> its copy, least recently on standby first
        self._in_use: set[Path] = set()  # copies a resident version (or a load in progress) reads
        self._writing: dict[Path, int] = {}  # copies being written -> their bytes, counted in the budget
        self._copier: ThreadPoolExecutor | None = None
        if settings.enabled:
            settings.directory.mkdir(parents=True, exist_ok=True)
            for stale in settings.directory.glob(f"{COPY_PREFIX}*"):  # an earlier process's
                shutil.rmtree(stale, ignore_errors=True)
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="standby-memory")

    @property
    def bytes_held(self) -> int:
        """Bytes of the copies in memory and of those being written."""
        with self._lock:
            return self._used()

    @property
    def adapters_held(self) -> int:
        """Versions whose copy is in memory."""
        with self._lock:
            return len(self._copies)

    def holds(self, source: ResolvedSource) -> bool:
        """Whether the version of `source` has a copy in memory."""
        with self._lock:
            return source.path in self._copies

    def offer(self, source: ResolvedSource, *, wait: bool = False) -> None:
        """The version of `source` is on standby now: its copy becomes the most recent (and may
        leave memory again), or one is written on the tier's thread if its files fit, making
        room first. `wait`: return once that copy is written or given up."""
        if self._copier is None:
            return
        key = source.path
        size = _size_of(key)
        with self._lock:
            if key in self._copies:
                self._in_use.discard(key)
                self._copies.move_to_end(key)
                return
            if key in self._writing or size is None or not self._make_room(size):
                return
            self._writing[key] = size
        copying: Future[None] = self._copier.submit(self._write, source)
        if wait:
            copying.result()

    @contextlib.contextmanager
    def loading(self, source: ResolvedSource) -> Iterator[SnapshotFiles]:
        """The files a load of `source`'s version reads: its memory copy, if it has one, kept in
        memory from now on while the version is resident; else the disk copy. If the block
        fails, the copy may leave memory again, and leaves at once if it changed."""
        key = source.path
        with self._lock:
            copy = self._copies.get(key)
            if copy is not None:
                self._in_use.add(key)
                self._copies.move_to_end(key)
        if copy is None:
            yield SnapshotFiles(source.path, source.written)
            return
        try:
            yield copy.files
        except BaseException:
            with self._lock:
                self._in_use.discard(key)
                if not _intact(copy.files):
                    log.error("the memory copy of %s changed; it is dropped (the disk copy is loaded next)", key)
                    self._remove(key)
            raise

    def drop(self, source: ResolvedSource) -> None:
        """The version of `source` is unloaded or replaced: its copy leaves memory (one being
        written is removed once written)."""
        with self._lock:
            self._writing.pop(source.path, None)
            self._remove(source.path)

    def close(self) -> None:
        """Write no further copy and remove every copy."""
        if self._copier is not None:
            self._copier.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._writing.clear()
            for key in list(self._copies):
                self._remove(key)

    def _used(self) -> int:
        return sum(copy.size for copy in self._copies.values()) + sum(self._writing.values())

    def _make_room(self, size: int) -> bool:
        """Remove the copies least recently put on standby (never one in use) until `size` more
        bytes fit in the budget; nothing is removed if they cannot fit. Under the lock."""
        budget = self.settings.budget_bytes
        evictable = [key for key in self._copies if key not in self._in_use]
        if self._used() - sum(self._copies[key].size for key in evictable) + size > budget:
            return False
        for key in evictable:
            if self._used() + size <= budget:
                break
            log.info("the memory copy of %s leaves memory to make room (its version loads from disk)", key)
            self._remove(key)
        return True

    def _remove(self, key: Path) -> None:
        """Remove the copy of `key`, if any. Under the lock."""
        self._in_use.discard(key)
        copy = self._copies.pop(key, None)
        if copy is not None:
            shutil.rmtree(copy.files.path, ignore_errors=True)

    def _write(self, source: ResolvedSource) -> None:
        """Copy `source`'s files into memory (on the tier's thread) and keep the copy, unless the
        version was dropped meanwhile."""
        key = source.path
        try:
            files = copy_into(source, self.settings.directory)
        except (OSError, CopyMismatch) as error:
            log.error("the memory copy of %s was not made (the disk copy is loaded): %s", key, error)
            with self._lock:
                self._writing.pop(key, None)
            return
        with self._lock:
            size = self._writing.pop(key, None)
            if size is None:  # unloaded or replaced while it was written
                shutil.rmtree(files.path, ignore_errors=True)
                return
            self._copies[key] = _Copy(files, size)
        log.info("adapter snapshot %s kept in memory at %s", key, files.path)


def copy_into(source: ResolvedSource, directory: Path) -> SnapshotFiles:
    """A new private copy of `source`'s two files in `directory`, hashed as they are written and
    held to the digests the source verified (`CopyMismatch` otherwise; the copy is removed)."""
    target = Path(tempfile.mkdtemp(prefix=COPY_PREFIX, dir=directory))
    try:
        expected = source.content
        weights = _copy_file(source.path / ADAPTER_WEIGHTS, target / ADAPTER_WEIGHTS, expected.weights_sha256)
        config = _copy_file(source.path / ADAPTER_CONFIG, target / ADAPTER_CONFIG, expected.config_sha256)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    return SnapshotFiles(target, WrittenFiles(weights, config))


def _copy_file(origin: Path, target: Path, sha256: str) -> FileIdentity:
    """Copy one file, hashing every byte written; its identity once written."""
    with origin.open("rb") as read, open(target, "xb") as out:
        writer = HashedWriter(out)
        while chunk := read.read(CHUNK_BYTES):
            writer.write(chunk)
        written = writer.done()
    if written.sha256 != sha256:
        raise CopyMismatch(f"{origin.name} read for the memory copy has sha256 {written.sha256}, the agent verified {sha256}")
    return written.identity


def _size_of(snapshot: Path) -> int | None:
    """The bytes of a snapshot's two files; None if they cannot be read now."""
    try:
        return sum((snapshot / name).stat().st_size for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG))
    except OSError:
        return None


def _intact(files: SnapshotFiles) -> bool:
    """Whether a copy's files are still those written."""
    if files.written is None:
        return True
    try:
        now = (FileIdentity.of((files.path / name).stat()) for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG))
        return tuple(now) == (files.written.weights, files.written.config)
    except OSError:
        return False
