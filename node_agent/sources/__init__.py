"""Adapter sources: from a LoadAdapter URI to a private local copy of the adapter the ranks read.

Policy (docs/agent.md "Sources" and "Limits"), one module per concern:

* ``file:///absolute/dir`` (`files`) — only under a configured adapter root. Refused: relative
  paths, a host (``file://host/...``; only ``localhost`` is accepted), any ``..`` component (also
  percent-encoded), and any symlink whose target leaves the roots. The directory is walked
  through no-follow directory fds and its two files copied into an agent-private snapshot
  (mode 0700, in the cache directory or the system temp directory), hashed while copied.
* ``http(s)://host/base`` (`downloads`) — only under a configured source prefix
  (``allowed_sources``, ``--allow-source``; none: http(s) refused), checked for the URL as given
  and for every redirect hop by the rules the operator shares (`lorafleet_common.sources`): a
  directory-like URL without userinfo, query or fragment, with no ``.``/``..`` segment (also
  percent-encoded). Connections go only to checked addresses (`connections`): non-global
  addresses only inside ``allowed_networks`` (``--allow-source-network``), no environment
  proxies. Both files go into a fresh private directory of the cache under a size cap, a
  deadline, a minimum rate and the caller's cancellation (`watchdog`), at most ``max_concurrent_downloads`` at once.
* ``hf://ORG/REPO[@REVISION][/SUBDIR]`` (`hub`) — a Hub repository, read by the rule the
  operator shares (`lorafleet_common.hub`): the two files at one commit, from ``hub_endpoint``
  (``--hub-endpoint``, the fleet owner's), through the same downloader and checks as http(s).
* ``s3://BUCKET[/KEY-PREFIX]`` (`s3`) — two objects of the fleet owner's S3-compatible store
  (``--s3-endpoint``, never a request's), under an ``--allow-source s3://BUCKET/PREFIX`` entry,
  each GET signed with SigV4 (awscrt), through the same downloader; each object's version id or
  ETag is recorded in the source's revision. Without keys, the agent may sign with its pod's web
  identity (`web_identity`: the projected token exchanged at the fleet owner's STS).
* ``oci://REGISTRY/REPOSITORY[:TAG|@sha256:DIGEST]`` (`oci`) — an ORAS artifact whose two layers
  are the adapter's files, under an ``--allow-source oci://REGISTRY/REPO`` entry: the manifest
  pinned by its digest (the revision), every blob held to its descriptor's sha256 and size,
  any other layer (a pickle file) refused; through the same downloader.
* A source credential (`credentials`: ``Authorization: Bearer`` or ``Basic``; for s3:// an
  `S3Credential` that signs) is sent to the source's own URLs only, as an unredirected header,
  never logged or repeated.
* A load's revision (`SourceAccess`, the operator's record of what the source resolved to) is
  what the source must still resolve to: an oci:// tag the same manifest digest (``tag_moved``),
  any other source the same `ResolvedSource.revision` (``source_changed``). `source_revision`
  (ResolveSource) finds that revision before any load, under the same checks, copying nothing:
  an oci:// manifest alone, an s3:// object's HEAD.
* Any other scheme is refused, and so are credentials (``user:password@``) in any URI; no
  message or log line repeats a URI's userinfo or query (`redact_uri`), nor downloaded content.

Only those two files are ever read by the agent, and the engine reads only safetensors weights:
no pickle is ever opened. The sha256 of the weights file is always computed (it is what
ListAdapters reports and what "same content" compares) and checked against the request's
sha256 when one is given (`resolve`). Snapshots and downloads are owned by their
`ResolvedSource` (`copies`) and removed by `discard()`.

This module is the package's public face: the agent, the CLI and the tooling import these names.
"""

from lorafleet_common.sources import ADAPTER_CONFIG, ADAPTER_WEIGHTS, SourcePrefix, redact_uri
from lorafleet_common.storage import StoragePrefix, parse_allow_entry
from node_agent.sources.copies import CHUNK_BYTES, Content, HashedWriter, ResolvedSource, clean_cache, parse_sha256
from node_agent.sources.credentials import Credential, S3Credential, SourceAccess, SourceCredential
from node_agent.sources.downloads import DownloadProgress
from node_agent.sources.policy import (
    DEFAULT_DOWNLOAD_MIN_BYTES_PER_S,
    DEFAULT_DOWNLOAD_RATE_WINDOW_S,
    DEFAULT_DOWNLOAD_TIMEOUT_S,
    DEFAULT_HUB_ENDPOINT,
    DEFAULT_MAX_CONCURRENT_DOWNLOADS,
    DEFAULT_MAX_DOWNLOAD_BYTES,
    DEFAULT_S3_REGION,
    DEFAULT_SOCKET_TIMEOUT_S,
    SourcePolicy,
)
from node_agent.sources.resolve import resolve_source, source_revision
from node_agent.sources.web_identity import WebIdentity, WebIdentityCredentials, default_sts_endpoint

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "CHUNK_BYTES",
    "DEFAULT_DOWNLOAD_MIN_BYTES_PER_S",
    "DEFAULT_DOWNLOAD_RATE_WINDOW_S",
    "DEFAULT_DOWNLOAD_TIMEOUT_S",
    "DEFAULT_HUB_ENDPOINT",
    "DEFAULT_MAX_CONCURRENT_DOWNLOADS",
    "DEFAULT_MAX_DOWNLOAD_BYTES",
    "DEFAULT_S3_REGION",
    "DEFAULT_SOCKET_TIMEOUT_S",
    "Content",
    "Credential",
    "DownloadProgress",
    "HashedWriter",
    "ResolvedSource",
    "S3Credential",
    "SourceAccess",
    "SourceCredential",
    "SourcePolicy",
    "SourcePrefix",
    "StoragePrefix",
    "WebIdentity",
    "WebIdentityCredentials",
    "clean_cache",
    "default_sts_endpoint",
    "parse_allow_entry",
    "parse_sha256",
    "redact_uri",
    "resolve_source",
    "source_revision",
]
