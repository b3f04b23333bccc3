"""An adapter's two files, validated once by the driver and read by every rank as that very file.

A load is checked once, in the driver and before the command lock (`verify_adapter`): the files
are opened without following a symlink, hashed when the caller verified digests (the agent's
source check), and parsed and matched against the base model (config, patterns, safetensors
header; the bytes read through the held files, `SpecMemo` skipping the parse of bytes it has
validated before). The result, a `VerifiedAdapter`, carries the spec the driver plans
each rank's read by (`plan.plan_shard`) and each file's identity (device, inode, size,
mtime, ctime: `VerifiedFiles`). A rank parses nothing: it opens the files the same way, refuses
them unless their identity is the verified one, reads its shard through that open descriptor by
its plan and checks the identity unchanged afterwards.

Why identity rather than a digest per rank: any write to a file moves its ctime and a replaced
directory entry is another inode, so an equal identity before and after the read means the rank
read exactly the bytes the driver hashed and parsed — without every rank hashing the whole file
again (that cost tp passes over the file per load; docs/engine.md has the figures).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from node_agent.backend import FileDigests, FileIdentity, WrittenFiles
from node_agent.engine.adapters.errors import CONFIG_FILE, WEIGHTS_FILE, AdapterLoadError
from node_agent.engine.adapters.header import read_adapter_bytes
from node_agent.engine.adapters.memo import SpecMemo
from node_agent.engine.adapters.spec import AdapterSpec, read_adapter_spec

_READ_BYTES = 1 << 20


class ContentChanged(AdapterLoadError):
    """The files are no longer those that were verified: a rank (or the driver) would read other
    bytes than the ones checked. The load is refused on every rank."""


class CannotOpen(AdapterLoadError):
    """A file of the adapter cannot be opened (missing, a symlink, unreadable)."""


@dataclass(frozen=True)
class VerifiedFiles:
    """Which versions of an adapter's two files the driver checked: what a rank holds its reads to."""

    path: Path
    weights: FileIdentity
    config: FileIdentity
    digests: FileDigests | None  # the digests the caller verified and the driver confirmed, if any


@dataclass(frozen=True)
class VerifiedAdapter:
    """An adapter checked once by the driver: its spec (for the driver to plan every rank's
    read by) and the verified files (which go to the ranks with their plans)."""

    spec: AdapterSpec
    files: VerifiedFiles


class HeldFiles:
    """The adapter's two files, opened without following a symlink, with their identities.

    `weights_fd` is what a rank reads its shard through; `check_unchanged` proves afterwards that
    the descriptors still hold the same versions and that the directory still names them.
    """

    def __init__(self, path: Path, who: str) -> None:
        self.path, self.who = Path(path), who
        # Joined once, as strings: a rank opens and re-checks both on every load.
        self.paths = {name: os.path.join(self.path, name) for name in (WEIGHTS_FILE, CONFIG_FILE)}
        self.fds: dict[str, int] = {}
        self.identities: dict[str, FileIdentity] = {}

    def __enter__(self) -> HeldFiles:
        try:
            for name in (WEIGHTS_FILE, CONFIG_FILE):
                self.fds[name] = os.open(self.paths[name], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
                self.identities[name] = FileIdentity.of(os.fstat(self.fds[name]))
        except OSError as error:
            self.close()
            raise CannotOpen(_open_error(self.path, error)) from None
        return self

    @property
    def weights_fd(self) -> int:
        """The open weights file."""
        return self.fds[WEIGHTS_FILE]

    def digests(self) -> FileDigests:
        """The sha256 of both files, read through the held descriptors."""
        return FileDigests(_sha256(self.fds[WEIGHTS_FILE]), _sha256(self.fds[CONFIG_FILE]))

    def are(self, written: WrittenFiles | None) -> bool:
        """Whether the held files are the versions their writer recorded (False for None)."""
        return written is not None and (self.identities[WEIGHTS_FILE], self.identities[CONFIG_FILE]) == (written.weights, written.config)

    def require(self, verified: VerifiedFiles) -> None:
        """Refuse files that are not the verified versions (ContentChanged)."""
        for name, want in ((WEIGHTS_FILE, verified.weights), (CONFIG_FILE, verified.config)):
            if self.identities[name] != want:
                raise ContentChanged(
                    f"{self.who} read other bytes than the agent verified: {name} "
                    f"is not the file that was verified (it was replaced or written to since)"
                )

    def check_unchanged(self) -> None:
        """Refuse the read if a file was written to or its directory entry replaced while held."""
        for name, fd in self.fds.items():
            now = FileIdentity.of(os.fstat(fd))
            try:
                entry = os.stat(self.paths[name], follow_symlinks=False)
            except OSError:
                entry = None
            if now != self.identities[name] or entry is None or (entry.st_dev, entry.st_ino) != (now.device, now.inode):
                raise ContentChanged(f"{name} changed while {self.who} read it")

    def close(self) -> None:
        """Close the descriptors."""
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def __exit__(self, *exc: object) -> None:
        self.close()


def verify_adapter(path: Path, specs: SpecMemo, expected: FileDigests | None, written: WrittenFiles | None = None) -> VerifiedAdapter:
    """Check an adapter once for every rank: its files' digests (when `expected`; hashed unless
    the files are still the `written` ones), its config, patterns and header against the base
    model of `specs` (which remembers the specs of bytes it validated before). Raises
    AdapterLoadError naming the problem."""
    try:
        with HeldFiles(path, "the driver") as held:
            return _verify_held(held, specs, expected, written)
    except CannotOpen:
        read_adapter_spec(Path(path), specs.cfg, specs.max_lora_rank)  # its refusal names a missing or pickled file exactly
        raise


def _verify_held(held: HeldFiles, specs: SpecMemo, expected: FileDigests | None, written: WrittenFiles | None) -> VerifiedAdapter:
    if expected is not None and not held.are(written):
        read = held.digests()
        if read != expected:
            raise ContentChanged(_digest_mismatch(read, expected))
    try:
        # The spec is parsed from the bytes read through the held descriptors: the very files
        # whose identity the ranks are held to.
        data = read_adapter_bytes(held.fds[CONFIG_FILE], held.weights_fd)
    except OSError:
        data = None  # not a readable regular file: the path-based check below names why
    spec = read_adapter_spec(held.path, specs.cfg, specs.max_lora_rank) if data is None else specs.spec(held.path, data)
    held.check_unchanged()
    weights, config = held.identities[WEIGHTS_FILE], held.identities[CONFIG_FILE]
    if spec.file_size != weights.size:
        raise ContentChanged(f"{WEIGHTS_FILE} changed while the driver read it")
    return VerifiedAdapter(spec, VerifiedFiles(held.path, weights, config, expected))


def _open_error(path: Path, error: OSError) -> str:
    """Why a file of the adapter cannot be held (a symlink, unreadable, gone)."""
    name = Path(error.filename).name if error.filename else "a file"
    if os.path.islink(path / name):
        return f"{name} in {path} is a symlink; adapter files are never read through one"
    return f"{name} in {path} cannot be opened: {error.strerror or error}"


def _digest_mismatch(read: FileDigests, expected: FileDigests) -> str:
    wrong = [
        f"{what} has sha256 {got}, the agent verified {want}"
        for what, got, want in (
            (WEIGHTS_FILE, read.weights_sha256, expected.weights_sha256),
            (CONFIG_FILE, read.config_sha256, expected.config_sha256),
        )
        if got != want
    ]
    return f"the driver read other bytes than the agent verified: {'; '.join(wrong)}"


def _sha256(fd: int) -> str:
    digest = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, _READ_BYTES, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()
