"""Which adapter sources a LoraFleet admits: the fleet owner's ``spec.sources.allow`` prefixes.

Remote sources (http(s) and hf://) are off for a fleet until its owner names prefixes; file://
sources are bounded by the agents' adapter roots instead. Two kinds of prefix:

* ``http(s)://host[:port]/path``: covers a source by the rule the agents apply to their own
  ``--allow-source`` (`lorafleet_common.sources`): same scheme, host and port, the path equal or
  continued after a ``/``, and the source a directory URL without userinfo, query, fragment or
  dot segments whose two files lie under the fleet's prefixes; an entry that is no valid prefix
  covers nothing;
* ``hf://ORG/`` (every repository of the organisation) or ``hf://ORG/REPO`` (that repository,
  at any revision and in any folder): compared by name, on the URI as the agents read it
  (`lorafleet_common.hub`), so ``hf://org/lora`` does not cover ``hf://org/lora2``,
  ``hf://org/`` does not cover ``hf://organisation/x``, and a URI the agents refuse is admitted
  under no prefix;
* ``s3://BUCKET[/PREFIX]`` and ``oci://REGISTRY[/REPOSITORY]``: by the rule the agents apply
  (`lorafleet_common.storage`): the same bucket or registry, the key prefix or repository equal
  or continued after a ``/``; a URI the agents refuse (traversal, an endpoint where the bucket
  goes) is admitted under no prefix. Where the bytes come from (the S3 endpoint, plain-HTTP
  registries) is the agents' configuration, never the adapter's.

The agents check again (their own ``--allow-source``; for hf:// the endpoint they fetch from).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from lorafleet_common.hub import PREFIX as HUB_PREFIX
from lorafleet_common.hub import HubSource, InvalidHubUri, parse_hub_uri
from lorafleet_common.sources import HUB_SCHEME, SourcePrefix, SourceRefusal, check_http_source, is_remote, scheme_of
from lorafleet_common.storage import STORAGE_SCHEMES, InvalidStorageUri, StoragePrefix, storage_refusal

# is_remote is the shared rule, re-exported for the operator's readers.
__all__ = ["admitted", "is_remote", "why_refused"]

#: What a refusal says, for the adapter's status: what is wrong with the URI, never its parts.
_WHY = {
    SourceRefusal.INVALID: "it is not a valid source URI of its scheme",
    SourceRefusal.CREDENTIALS: "it carries credentials (user:password@): they come from a Secret, never the URI",
    SourceRefusal.NOT_A_DIRECTORY: "it has a query or fragment",
    SourceRefusal.DOT_SEGMENT: "a path, key or repository segment is '.' or '..' (traversal)",
    SourceRefusal.NOT_COVERED: "it is under none of the fleet's spec.sources.allow prefixes",
    SourceRefusal.ENDPOINT: "it names a host or port where the bucket goes: the S3 endpoint is the fleet owner's, never an adapter's",
}


@functools.lru_cache(maxsize=256)
def _http_prefix(entry: str) -> SourcePrefix | None:
    try:
        return SourcePrefix.parse(entry)
    except ValueError:
        return None


def _under_hub_prefix(source: HubSource, prefix: str) -> bool:
    wanted = [name for name in prefix[len(HUB_PREFIX) :].split("/") if name]
    return bool(wanted) and len(wanted) <= 2 and [source.organisation, source.repository][: len(wanted)] == wanted


@functools.lru_cache(maxsize=256)
def _storage_prefix(entry: str) -> StoragePrefix | None:
    try:
        return StoragePrefix.parse(entry)
    except InvalidStorageUri:
        return None


def _storage_refusal(uri: str, allow: Sequence[str]) -> SourceRefusal | None:
    entries = (entry for entry in allow if scheme_of(entry) in STORAGE_SCHEMES)
    prefixes = tuple(prefix for entry in entries if (prefix := _storage_prefix(entry)) is not None)
    return storage_refusal(uri, prefixes)


def _hub_refusal(uri: str, allow: Sequence[str]) -> SourceRefusal | None:
    try:
        source = parse_hub_uri(uri)
    except InvalidHubUri:
        return SourceRefusal.INVALID  # the agents refuse it
    covered = any(_under_hub_prefix(source, prefix) for prefix in allow if prefix.startswith(HUB_PREFIX))
    return None if covered else SourceRefusal.NOT_COVERED


def _http_refusal(uri: str, allow: Sequence[str]) -> SourceRefusal | None:
    # All prefixes together, as an agent holds its --allow-source: each file may lie under any.
    prefixes = [prefix for entry in allow if not entry.startswith(HUB_PREFIX) if (prefix := _http_prefix(entry)) is not None]
    return check_http_source(uri, prefixes)


def refusal(uri: str, allow: Sequence[str]) -> SourceRefusal | None:
    """Why the fleet does not admit this source (None: it does: not remote, or under its
    ``spec.sources.allow``)."""
    if not is_remote(uri):
        return None
    if scheme_of(uri) == HUB_SCHEME:
        return _hub_refusal(uri, allow)
    if scheme_of(uri) in STORAGE_SCHEMES:
        return _storage_refusal(uri, allow)
    return _http_refusal(uri, allow)


def admitted(uri: str, allow: Sequence[str]) -> bool:
    """Whether the fleet admits this source (:func:`refusal`)."""
    return refusal(uri, allow) is None


def why_refused(uri: str, allow: Sequence[str]) -> str:
    """What the adapter's status says when the fleet does not admit its source ("" when it does)."""
    why = refusal(uri, allow)
    return _WHY[why] if why is not None else ""
