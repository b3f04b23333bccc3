"""The agent's private copies of adapters: the directory the ranks read, the files written and
hashed into it, and what identifies their content."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from node_agent.engine import FileDigests, FileIdentity, WrittenFiles
from node_agent.errors import InvalidRequest, SourceUnavailable
from node_agent.sources.policy import SourcePolicy

MAX_CONFIG_BYTES = 1 << 20
CHUNK_BYTES = 1 << 20
DOWNLOAD_PREFIX = "dl-"
SNAPSHOT_PREFIX = "snap-"
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")

# What identifies an adapter's content: the digests of its two files, in the engine's own record
# of them, so what a source verified compares directly with what each rank reports it read.
Content = FileDigests


@dataclass(frozen=True)
class Written:
    """A file the agent wrote: the sha256 of every byte written, and its identity after the last."""

    sha256: str
    identity: FileIdentity


class HashedWriter:
    """Writes a new file of a snapshot or a download and hashes the same bytes on the way."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out, self.digest = out, hashlib.sha256()

    def write(self, chunk: bytes) -> None:
        self.digest.update(chunk)
        self.out.write(chunk)

    def done(self) -> Written:
        """The digest, and the identity taken through the descriptor once every byte is out (a
        stat by path could name another file by then)."""
        self.out.flush()
        return Written(self.digest.hexdigest(), FileIdentity.of(os.fstat(self.out.fileno())))


@dataclass(frozen=True)
class ResolvedSource:
    """A checked private adapter directory: a download (`downloaded`) or a file:// snapshot.

    `owned` copies are the agent's and are removed by `discard()`.
    """

    uri: str
    path: Path
    content: Content
    downloaded: bool = False
    owned: bool = False
    # hf://: the commit both files were fetched at; s3://: each object's version id or ETag;
    # oci://: the manifest's digest
    revision: str = ""
    # The files' identities once written and hashed: the engine need not hash them again.
    written: WrittenFiles | None = None

    @classmethod
    def of_copy(cls, uri: str, path: Path, weights: Written, config: Written, downloaded: bool, revision: str = "") -> ResolvedSource:
        """The agent's own copy at `path`, from what was written into it."""
        return cls(
            uri,
            path,
            Content(weights.sha256, config.sha256),
            downloaded=downloaded,
            owned=True,
            revision=revision,
            written=WrittenFiles(weights.identity, config.identity),
        )

    def discard(self) -> None:
        """Remove the agent's private copy (downloads and snapshots)."""
        if self.downloaded or self.owned:
            shutil.rmtree(self.path, ignore_errors=True)


def parse_sha256(value: str) -> str | None:
    """The request's optional sha256 (empty = none), normalised to lowercase hex."""
    if not value:
        return None
    normalised = value.strip().lower()
    if not _SHA256_HEX.match(normalised):
        raise InvalidRequest(f"sha256 must be 64 hex digits, got {value!r}")
    return normalised


def private_dir(policy: SourcePolicy, prefix: str) -> Path:
    """A fresh directory only this process's user can enter (mkdtemp: mode 0700)."""
    where = policy.cache_dir if policy.cache_dir is not None else Path(tempfile.gettempdir())
    try:
        if policy.cache_dir is None:
            return Path(tempfile.mkdtemp(prefix=f"lorafleet-{prefix}"))
        Path(policy.cache_dir).mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=prefix, dir=policy.cache_dir))
    except OSError as error:
        raise SourceUnavailable(
            f"the adapter cache directory {where} is not usable ({error.strerror or error}): --cache-dir must name a writable directory",
            "cache_unavailable",
        ) from None


def clean_cache(cache_dir: Path) -> None:
    """Remove downloads and snapshots left by an earlier process (a fresh agent holds no adapters)."""
    for prefix in (DOWNLOAD_PREFIX, SNAPSHOT_PREFIX):
        for stale in Path(cache_dir).glob(f"{prefix}*"):
            shutil.rmtree(stale, ignore_errors=True)
