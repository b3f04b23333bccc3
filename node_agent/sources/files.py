"""file:// sources: the adapter directory walked from an adapter root through no-follow directory
fds, its two files copied and hashed into an agent-private snapshot.

The path is walked from the root one component at a time through directory file descriptors
opened with ``O_NOFOLLOW``: the kernel never follows a symlink by itself; a symlink met on the
way is read and resolved by the walk, and followed only while it stays inside a root (Kubernetes
volumes are built from such links). The two adapter files are opened the same way
(``O_NONBLOCK``: a FIFO is refused, not waited on), read once into a snapshot directory (mode
0700) and hashed while copied. The ranks load the snapshot, so the bytes that were checked and
hashed are exactly the bytes every rank reads, whatever happens under the root meanwhile.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import unquote

from lorafleet_common.sources import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from node_agent.errors import SourceNotFound, SourceRefused, SourceUnavailable
from node_agent.sources.copies import CHUNK_BYTES, MAX_CONFIG_BYTES, SNAPSHOT_PREFIX, HashedWriter, ResolvedSource, Written, private_dir
from node_agent.sources.policy import SourcePolicy

log = logging.getLogger(__name__)

MAX_SYMLINKS = 40  # symlinks followed while walking one path (the kernel's own limit)


def resolve_file(uri: str, shown: str, host: str, raw_path: str, extra: str, policy: SourcePolicy) -> ResolvedSource:
    """A private snapshot of the adapter directory a file:// URI names under an adapter root."""
    path = _checked_path(shown, host, unquote(raw_path), extra)  # %2e%2e is '..' to every check
    if not policy.adapter_roots:
        raise SourceRefused("file:// sources are refused: the agent has no --adapter-root", "outside_roots")
    roots = [(os.path.abspath(root), os.path.realpath(root)) for root in policy.adapter_roots]
    with _Beneath(roots, shown) as beneath:
        start = beneath.locate(os.path.normpath(path))
        if start is None:
            raise SourceRefused(f"{shown!r} is outside the adapter roots ({', '.join(r for r, _ in roots)})", "outside_roots")
        directory = beneath.walk(
            [beneath.root_fd(start[0])], start[1], want_dir=True, missing=f"adapter directory {shown!r} does not exist"
        )
        files = {name: _open_file(beneath, directory, name, cap, shown) for name, cap in _caps(policy)}
        snapshot = private_dir(policy, SNAPSHOT_PREFIX)
        try:
            written = {name: _copy_fd(fd, snapshot / name, cap, f"{name} in {shown!r}") for name, (fd, cap) in files.items()}
        except BaseException:
            shutil.rmtree(snapshot, ignore_errors=True)
            raise
    log.debug("snapshotted %s into %s", shown, snapshot)
    return ResolvedSource.of_copy(uri, snapshot, written[ADAPTER_WEIGHTS], written[ADAPTER_CONFIG], downloaded=False)


def _checked_path(shown: str, host: str, path: str, extra: str) -> str:
    """Refuse a host, a relative path, a query or fragment, a NUL and any ``..`` component."""
    if host not in ("", "localhost"):
        raise SourceRefused(
            f"file URI {shown!r} names the host {host!r}: hosts are not supported (relative path refused: "
            "file URIs need an absolute local path, file:///dir)",
            "file_host",
        )
    if not path.startswith("/"):
        raise SourceRefused(f"relative path refused in {shown!r}: file URIs need an absolute path (file:///dir)", "relative_path")
    if extra or "\x00" in path:
        raise SourceRefused(f"file URI {shown!r} must be a plain path (no query, fragment or NUL)", "bad_uri")
    if ".." in PurePosixPath(path).parts:
        raise SourceRefused(f"'..' is refused in source paths: {shown!r}", "traversal")
    return path


def _caps(policy: SourcePolicy) -> tuple[tuple[str, int], ...]:
    return (ADAPTER_CONFIG, MAX_CONFIG_BYTES), (ADAPTER_WEIGHTS, policy.max_download_bytes)


def _open_file(beneath: _Beneath, directory: list[int], name: str, cap: int, shown: str) -> tuple[int, int]:
    """One adapter file opened beneath `directory`, refused over `cap`; its fd and the cap."""
    missing = f"{name} not found in {shown!r} (only safetensors adapters are served; pickle files are never read)"
    fd = beneath.walk(directory, [name], want_dir=False, missing=missing)[-1]
    size = os.fstat(fd).st_size
    if size > cap:
        raise SourceRefused(f"{name} in {shown!r} is {size} bytes, over the {cap}-byte cap", "too_large")
    return fd, cap


def _copy_fd(fd: int, dest: Path, cap: int, what: str) -> Written:
    """Copy an open file into `dest` (never more than `cap` bytes); what was written."""
    total = 0
    try:
        with open(dest, "xb") as out:
            writer = HashedWriter(out)
            while chunk := os.read(fd, CHUNK_BYTES):
                total += len(chunk)
                if total > cap:  # the file grew after it was measured
                    raise SourceRefused(f"{what} exceeds the {cap}-byte cap", "too_large")
                writer.write(chunk)
            return writer.done()
    except OSError as error:  # a read error under the root, or a full cache
        raise SourceUnavailable(f"copying {what} into {dest.parent} failed: {error.strerror or error}", "snapshot_failed") from None


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return name
    return "a special file"


@dataclass
class _Walk:
    """One walk's state: the open directory fds from the root down, the components still to
    open, and the symlinks followed so far."""

    stack: list[int]
    pending: collections.deque[str]
    links: int = 0


class _Beneath:
    """Opens paths beneath the adapter roots through directory fds, one component at a time.

    Every open uses ``O_NOFOLLOW`` relative to the directory fd the walk holds, so the kernel
    never resolves a symlink: a symlink met on the way is read (``readlink`` on that fd) and its
    target walked in turn, from the same directory (relative) or from the root it names
    (absolute). ``..`` steps back to the directory the walk came from and never above the root.
    A symlink out of the roots is refused, however briefly it was there.
    """

    def __init__(self, roots: list[tuple[str, str]], shown: str) -> None:
        self.roots = roots  # (absolute path, real path) of each root
        self.shown = shown
        self._root_fds: dict[int, int] = {}
        self._held: list[int] = []  # the fds of finished walks, closed at exit

    def __enter__(self) -> _Beneath:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in [*self._root_fds.values(), *self._held]:
            os.close(fd)

    def locate(self, path: str) -> tuple[int, list[str]] | None:
        """The root `path` lies under (lexically) and the components below it."""
        for index, prefixes in enumerate(self.roots):
            for prefix in prefixes:
                if _within(path, prefix):
                    return index, [p for p in PurePosixPath(os.path.relpath(path, prefix)).parts if p != "."]
        return None

    def root_fd(self, index: int) -> int:
        """The open directory fd of one root (opened once per walk set)."""
        if index not in self._root_fds:
            real = self.roots[index][1]
            try:
                self._root_fds[index] = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as error:
                raise SourceNotFound(f"adapter root {real} cannot be opened ({error.strerror}) for {self.shown!r}") from None
        return self._root_fds[index]

    def walk(self, start: list[int], parts: list[str], want_dir: bool, missing: str) -> list[int]:
        """Open `parts` below the directory stack `start`; the new stack's fds stay open until exit."""
        state = _Walk([os.dup(fd) for fd in start], collections.deque(parts))
        try:
            while state.pending:
                self._step(state, want_dir, missing)
            self._held.extend(state.stack)
            return state.stack
        except BaseException:
            for held in state.stack:
                os.close(held)
            raise

    def _step(self, state: _Walk, want_dir: bool, missing: str) -> None:
        """Open the next component (``..``: step back), or follow the symlink it is."""
        name = state.pending.popleft()
        if name in ("", "."):
            return
        if name == "..":
            if len(state.stack) == 1:
                raise SourceRefused(f"{self.shown!r} leads through a symlink above its adapter root", "symlink_escape")
            os.close(state.stack.pop())
            return
        directory = want_dir or bool(state.pending)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | (os.O_DIRECTORY if directory else 0)
        try:
            fd = os.open(name, flags, dir_fd=state.stack[-1])
        except OSError as error:
            self._follow(state, name, directory, error, missing)
            return
        state.stack.append(fd)
        if not directory and not stat.S_ISREG(mode := os.fstat(fd).st_mode):
            raise SourceRefused(f"{name!r} in {self.shown!r} is {_kind(mode)}, not a regular file", "not_a_file")

    def _follow(self, state: _Walk, name: str, directory: bool, error: OSError, missing: str) -> None:
        """After `name` failed to open: walk its symlink target next (absolute: from the root it
        lies under), or `name` again when it changed under the walk."""
        state.links += 1
        if state.links > MAX_SYMLINKS:
            raise SourceRefused(f"{self.shown!r}: too many symlinks (or a path changing under the walk)", "symlink_loop") from None
        target = self._classify(state.stack[-1], name, directory, error, missing)
        if target is None:  # the entry changed between open and lstat: look again
            state.pending.appendleft(name)
        elif os.path.isabs(target):
            found = self.locate(os.path.normpath(target))
            if found is None:
                raise SourceRefused(
                    f"{name!r} in {self.shown!r} is a symlink to {target}, outside the adapter roots", "symlink_escape"
                ) from None
            root = os.dup(self.root_fd(found[0]))
            for held in state.stack:
                os.close(held)
            state.stack = [root]
            state.pending.extendleft(reversed(found[1]))
        else:
            state.pending.extendleft(reversed(PurePosixPath(target).parts))

    def _classify(self, dir_fd: int, name: str, directory: bool, error: OSError, missing: str) -> str | None:
        """Why opening `name` failed: its symlink target, None to retry, or a refusal."""
        try:
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
            if stat.S_ISLNK(mode):
                return os.readlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            raise SourceNotFound(missing) from None
        except OSError as again:
            if again.errno == errno.EINVAL:  # readlink: no longer a symlink
                return None
            raise SourceRefused(f"{name!r} in {self.shown!r} cannot be read ({again.strerror})", "unreadable") from None
        if directory and not stat.S_ISDIR(mode):
            raise SourceRefused(f"{name!r} in {self.shown!r} is {_kind(mode)}, not a directory", "not_a_directory")
        if directory or stat.S_ISREG(mode):
            if error.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                return None  # it was a symlink (or missing) a moment ago
            raise SourceRefused(f"{name!r} in {self.shown!r} cannot be opened ({error.strerror})", "unreadable")
        raise SourceRefused(f"{name!r} in {self.shown!r} is {_kind(mode)}, not a regular file", "not_a_file")


def _within(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root
