"""What an agent reports of its registry: one value both sides use for `lorafleet.v1.AdapterInfo`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RegistryEntry:
    """One routable adapter of an agent's registry (ListAdapters), with the ranks that hold it."""

    name: str
    source_uri: str
    sha256: str
    pinned: bool
    ranks: tuple[int, ...]
    standby: bool = False  # held verified on disk, loaded by its first request; no rank holds it
