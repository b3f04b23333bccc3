"""Where adapters may come from and the limits on downloads: `SourcePolicy`, set by the fleet's
owner (the agent's flags), never by a request; and the check of every URL a download fetches."""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

from lorafleet_common.sources import ALLOW_SOURCE_FLAG, HTTP_SCHEMES, SourcePrefix, SourceRefusal, check_url
from lorafleet_common.storage import InvalidStorageUri, StoragePrefix, parse_allow_entry, storage_refusal
from node_agent.errors import SourceRefused
from node_agent.sources.credentials import S3Credential, S3CredentialSource

DEFAULT_MAX_DOWNLOAD_BYTES = 4 << 30
DEFAULT_DOWNLOAD_TIMEOUT_S = 600.0
DEFAULT_DOWNLOAD_MIN_BYTES_PER_S = 64 << 10
DEFAULT_DOWNLOAD_RATE_WINDOW_S = 10.0
DEFAULT_SOCKET_TIMEOUT_S = 30.0
DEFAULT_MAX_CONCURRENT_DOWNLOADS = 8
DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
DEFAULT_S3_REGION = "us-east-1"
ALLOW_NETWORK_FLAG = "--allow-source-network"

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
StorageT = TypeVar("StorageT")


@functools.lru_cache(maxsize=64)
def _parsed_prefixes(entries: tuple[str, ...]) -> tuple[SourcePrefix | StoragePrefix, ...]:
    """The parsed ``--allow-source`` entries (http(s), s3:// and oci:// prefixes); ValueError
    naming the flag and the entry."""
    return tuple(parse_allow_entry(entry) for entry in entries)


def check_endpoint_url(url: str, flag: str = "--s3-endpoint") -> None:
    """An endpoint the fleet's owner names (`flag`: --s3-endpoint, --s3-sts-endpoint) is an
    http(s) URL with a host and nothing after its path."""
    try:
        parts = urlsplit(url)
        _ = parts.port
    except ValueError:
        raise ValueError(f"{flag} {url!r} is not a valid URL") from None
    if parts.scheme not in HTTP_SCHEMES or not parts.hostname or "@" in parts.netloc or parts.query or parts.fragment or "?" in url:
        raise ValueError(f"{flag} must be an http:// or https:// URL with a host and no credentials, query or fragment")


@functools.lru_cache(maxsize=64)
def _parsed_networks(entries: tuple[str, ...]) -> tuple[Network, ...]:
    """The parsed ``--allow-source-network`` entries; ValueError naming the flag and the entry."""
    parsed = []
    for entry in entries:
        try:
            parsed.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ValueError(f"{ALLOW_NETWORK_FLAG} {entry!r} is not an IP network (CIDR such as 127.0.0.1/32 or 10.0.0.0/8)") from None
    return tuple(parsed)


@dataclass(frozen=True)
class SourcePolicy:
    """Where adapters may come from, where their copies go, and the limits on downloads."""

    adapter_roots: tuple[Path, ...] = ()
    cache_dir: Path | None = None
    # cap on adapter_model.safetensors, downloaded or snapshotted (adapter_config.json: 1 MiB)
    max_download_bytes: int = DEFAULT_MAX_DOWNLOAD_BYTES
    download_timeout_s: float = DEFAULT_DOWNLOAD_TIMEOUT_S  # overall deadline of one source's download
    # the download fails when fewer bytes than this per second arrived over the last window
    download_min_bytes_per_s: int = DEFAULT_DOWNLOAD_MIN_BYTES_PER_S
    download_rate_window_s: float = DEFAULT_DOWNLOAD_RATE_WINDOW_S
    download_socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S  # per socket operation
    max_concurrent_downloads: int = DEFAULT_MAX_CONCURRENT_DOWNLOADS  # per cache directory
    # URL prefixes http(s) sources (and every redirect hop) must lie under (--allow-source);
    # none: http(s) sources are refused. The fleet's owner sets them (the chart), never a request.
    allowed_sources: tuple[str, ...] = ()
    # Networks (CIDR) downloads may connect to although they are loopback, link-local, private or
    # otherwise not global (--allow-source-network); public addresses never need one.
    allowed_networks: tuple[str, ...] = ()
    # Where hf:// sources are fetched from (--hub-endpoint): the Hub or a mirror, the fleet
    # owner's choice; it must lie under an allowed source prefix like any http(s) URL.
    hub_endpoint: str = DEFAULT_HUB_ENDPOINT
    # The S3-compatible store s3:// sources are read from (--s3-endpoint, path-style requests:
    # ENDPOINT/BUCKET/KEY) and the region requests are signed for (--s3-region); no endpoint:
    # s3:// sources are refused. Never taken from a request.
    s3_endpoint: str = ""
    s3_region: str = DEFAULT_S3_REGION
    # The agent's own S3 credential (the pod's environment); a load's own credential wins.
    s3_credential: S3Credential | None = None
    # Else the pod's web identity exchanged at STS (--s3-web-identity, `web_identity`).
    s3_web_identity: S3CredentialSource | None = None
    # Registries (host[:port]) oci:// sources reach over plain HTTP (--oci-plain-http); others: https.
    oci_plain_http: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _parsed_prefixes(tuple(self.allowed_sources))  # ValueError naming the flag and the entry
        _parsed_networks(tuple(self.allowed_networks))
        if self.s3_endpoint:
            check_endpoint_url(self.s3_endpoint)
        for name in (
            "max_download_bytes",
            "download_timeout_s",
            "download_rate_window_s",
            "download_socket_timeout_s",
            "max_concurrent_downloads",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"SourcePolicy.{name} must be positive, got {getattr(self, name)!r}")
        if self.download_min_bytes_per_s < 0:
            raise ValueError(f"SourcePolicy.download_min_bytes_per_s must be >= 0, got {self.download_min_bytes_per_s!r}")

    @property
    def prefixes(self) -> tuple[SourcePrefix, ...]:
        """The http(s) prefixes sources and every redirect hop must lie under."""
        return tuple(p for p in _parsed_prefixes(tuple(self.allowed_sources)) if isinstance(p, SourcePrefix))

    @property
    def storage_prefixes(self) -> tuple[StoragePrefix, ...]:
        """The s3:// bucket and oci:// registry prefixes sources must lie under."""
        return tuple(p for p in _parsed_prefixes(tuple(self.allowed_sources)) if isinstance(p, StoragePrefix))

    @property
    def networks(self) -> tuple[Network, ...]:
        """The non-public networks downloads may connect to."""
        return _parsed_networks(tuple(self.allowed_networks))


def refusal_error(refusal: SourceRefusal, what: str, allowed: Sequence[SourcePrefix]) -> SourceRefused:
    """The agent's words and stable reason for a refusal under the shared source rules; with no
    allowed prefix at all, every URL is refused as not allowed (a query or userinfo first)."""
    if refusal is SourceRefusal.NOT_A_DIRECTORY:
        return SourceRefused(f"http(s) sources are directory URLs without query or fragment: {what}", "bad_uri")
    if refusal is SourceRefusal.CREDENTIALS:
        return SourceRefused(f"credentials in URLs are refused: {what}", "credentials")
    if not allowed:
        return SourceRefused(
            f"{what} is refused: this agent allows no http(s) sources; the fleet's owner names the URL prefixes "
            f"agents may fetch from with {ALLOW_SOURCE_FLAG} PREFIX (e.g. https://huggingface.co/)",
            "source_not_allowed",
        )
    if refusal is SourceRefusal.INVALID:
        return SourceRefused(f"{what} is not a valid URL", "bad_uri")
    if refusal is SourceRefusal.DOT_SEGMENT:
        return SourceRefused(f"'.' and '..' path segments are refused in http(s) URLs: {what}", "traversal")
    return SourceRefused(f"{what} is not under any source prefix this agent allows ({ALLOW_SOURCE_FLAG})", "source_not_allowed")


def admit_storage_source(uri: str, policy: SourcePolicy, shown: str, parse: Callable[[str], StorageT], example: str) -> StorageT:
    """The s3:// or oci:// source `uri` names (read by the shared rule `parse`), once an allowed
    prefix covers it; SourceRefused with the reason otherwise (`example`: the flag's form)."""
    try:
        source = parse(uri)
    except InvalidStorageUri as error:
        reasons = {SourceRefusal.DOT_SEGMENT: "traversal", SourceRefusal.ENDPOINT: "endpoint", SourceRefusal.CREDENTIALS: "credentials"}
        raise SourceRefused(str(error), reasons.get(error.refusal, "bad_uri")) from None
    if storage_refusal(uri, policy.storage_prefixes) is not None:
        raise SourceRefused(
            f"the source {shown!r} is not under any prefix this agent allows ({ALLOW_SOURCE_FLAG} {example})", "source_not_allowed"
        )
    return source


def check_allowed(url: str, allowed: Sequence[SourcePrefix], what: str) -> None:
    """Refuse one URL a download would fetch unless an allowed prefix covers it (and its path has
    no dot segment); `what` names it in the message."""
    refusal = check_url(url, allowed) if allowed else SourceRefusal.NOT_COVERED
    if refusal is not None:
        raise refusal_error(refusal, what, allowed)
