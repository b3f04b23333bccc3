"""What a backend is told about an adapter's two files: the digests its source verified, and the
identities the files had once their writer hashed them.

Plain values, shared by the agent (its source check produces them) and every backend (the
builtin engine holds each rank's read to them; `node_agent.engine.adapters.files`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class FileDigests:
    """The sha256 (hex) of an adapter's two files: what a rank read, or what the agent verified."""

    weights_sha256: str
    config_sha256: str


@dataclass(frozen=True)
class FileIdentity:
    """What tells one version of a file from any other on the same machine."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        """The identity of a stat result."""
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class WrittenFiles:
    """The identities an adapter's two files had once their writer had written and hashed every
    byte of them (the agent's private snapshot, whose `FileDigests` are of those bytes). Files
    still of these identities hold those bytes, so a backend may take the digests as read
    instead of hashing the files again."""

    weights: FileIdentity
    config: FileIdentity
