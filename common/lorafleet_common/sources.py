"""Adapter source URIs: the rules the operator and every agent must read the same way.

The operator admits a LoraAdapter's source under its fleet's ``spec.sources.allow`` before it
sends a load; each agent checks the same source under its own ``--allow-source`` prefixes before
it downloads. Both call these functions, so a source the operator admits under a prefix is one
an agent with that prefix admits too:

* an http(s) prefix ``scheme://host[:port]/path`` (`SourcePrefix`) covers a URL when the scheme
  and host are equal (case-insensitive), the port equal (none given: the scheme's default;
  ``:*``: any port), and the URL's path equals the prefix's path or continues it after a ``/``:
  ``https://h/org`` covers ``https://h/org/x``, not ``https://h/organisation``, and ``https://h``
  never covers ``https://h.other``;
* an http(s) source is a directory URL without userinfo, query or fragment and without ``.`` or
  ``..`` path segments (also percent-encoded or after a backslash); it is admitted when a prefix
  covers both files an agent fetches from it (`source_file_urls`, `check_http_source`);
* a URI's userinfo, query and fragment are never shown (`redact_uri`).

hf:// URIs are read by `lorafleet_common.hub`; s3:// and oci:// URIs and their prefixes by
`lorafleet_common.storage`.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import SplitResult, unquote, urlsplit

HTTP_SCHEMES = ("http", "https")
HUB_SCHEME = "hf"
S3_SCHEME = "s3"
OCI_SCHEME = "oci"
REMOTE_SCHEMES = (*HTTP_SCHEMES, HUB_SCHEME, S3_SCHEME, OCI_SCHEME)
# The two files of an adapter directory: the only files a source is ever read for.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
# The agents' flag for their own prefixes; the fleets' are spec.sources.allow, checked by the CRD.
ALLOW_SOURCE_FLAG = "--allow-source"
DEFAULT_PORTS = {"http": 80, "https": 443}
ANY_PORT = -1
# Everything between "//" and the next "/": a userinfo is anything up to the last "@" in there
# (also when it holds a raw "?" or "#", which urlsplit would cut the netloc at).
_AUTHORITY = re.compile(r"^(?:[A-Za-z][A-Za-z0-9+.-]*:)?//(?P<authority>[^/]*)")
_ANY_PORT_SUFFIX = re.compile(r"^([A-Za-z]+://[^/]*):\*(?=/|$)")


class SourceRefusal(enum.Enum):
    """Why a source URI, or one URL fetched for it, is not admitted."""

    INVALID = "invalid"  # not a URI that can be read
    CREDENTIALS = "credentials"  # a userinfo (user:password@)
    NOT_A_DIRECTORY = "not_a_directory"  # a query or fragment: sources are directory URLs
    DOT_SEGMENT = "dot_segment"  # a '.' or '..' path segment
    NOT_COVERED = "not_covered"  # under no allowed prefix
    ENDPOINT = "endpoint"  # an s3:// URI that names a host or port: the endpoint is the fleet owner's


def scheme_of(uri: str) -> str:
    """A URI's scheme, lowercase ("" when it has none); one urlsplit cannot read counts as remote
    (`is_remote`), so that only a prefix could admit it, and none does."""
    try:
        return urlsplit(uri).scheme.lower()
    except ValueError:
        match = re.match(r"^\s*([A-Za-z][A-Za-z0-9+.-]*):", uri)
        return match.group(1).lower() if match else HTTP_SCHEMES[0]


def is_remote(uri: str) -> bool:
    """Whether the agents download this source (http(s), hf://, s3://, oci://, any case) rather than read
    it under their adapter roots (file://)."""
    return scheme_of(uri) in REMOTE_SCHEMES


def userinfo_span(uri: str) -> tuple[int, int] | None:
    """Where a URI's userinfo (``user:password@``) is, if it has one."""
    match = _AUTHORITY.match(uri)
    if match is None or "@" not in match.group("authority"):
        return None
    start = match.start("authority")
    return start, start + match.group("authority").rindex("@") + 1


def redact_uri(uri: str) -> str:
    """`uri` safe for messages and logs: userinfo becomes ``***@``, a query or fragment ``?<redacted>``."""
    span = userinfo_span(uri)
    shown = uri if span is None else uri[: span[0]] + "***@" + uri[span[1] :]
    cut = min((i for i in (shown.find("?"), shown.find("#")) if i >= 0), default=-1)
    return shown if cut < 0 else shown[:cut] + "?<redacted>"


def has_dot_segment(path: str) -> bool:
    """Whether a URL path has a ``.`` or ``..`` segment, also percent-encoded or after a backslash."""
    return any(segment in (".", "..") for segment in re.split(r"[/\\]", unquote(path)))


@dataclass(frozen=True)
class SourcePrefix:
    """One allowed http(s) prefix (an agent's ``--allow-source``, a fleet's ``spec.sources.allow``).

    ``scheme://host[:port]/path``: the scheme and host must be equal (case-insensitive), the port
    equal (none given: the scheme's default; ``:*``: any port), and the URL's path must equal
    the prefix's path or continue it after a ``/`` (``https://h/org`` covers ``https://h/org/x``,
    not ``https://h/organisation``).
    """

    scheme: str
    host: str
    port: int  # ANY_PORT: any
    path: str

    @classmethod
    def parse(cls, text: str) -> SourcePrefix:
        """The prefix `text` names; ValueError saying what is wrong (never its userinfo)."""
        any_port = _ANY_PORT_SUFFIX.sub(r"\1", text)
        try:
            parts = urlsplit(any_port)
            port = parts.port
        except ValueError as error:
            raise ValueError(f"{ALLOW_SOURCE_FLAG} {redact_uri(text)!r} is not a valid URL prefix: {error}") from None
        scheme = parts.scheme.lower()
        if scheme not in DEFAULT_PORTS or not parts.hostname:
            raise ValueError(
                f"{ALLOW_SOURCE_FLAG} {redact_uri(text)!r} must be an http:// or https:// URL with a host, e.g. https://huggingface.co/"
            )
        if "@" in parts.netloc or parts.query or parts.fragment or "?" in text or "#" in text:
            raise ValueError(f"{ALLOW_SOURCE_FLAG} {redact_uri(text)!r} must not have credentials, a query or a fragment")
        if has_dot_segment(parts.path):
            raise ValueError(f"{ALLOW_SOURCE_FLAG} {text!r} must not have '.' or '..' path segments")
        resolved_port = ANY_PORT if any_port != text else port if port is not None else DEFAULT_PORTS[scheme]
        return cls(scheme, parts.hostname.lower(), resolved_port, parts.path or "/")

    def covers(self, scheme: str, host: str, port: int, path: str) -> bool:
        """Whether a URL with these parts (scheme and host lowercase) lies under this prefix."""
        if (scheme, host) != (self.scheme, self.host) or self.port not in (ANY_PORT, port):
            return False
        path = path or "/"
        if self.path.endswith("/"):
            return path.startswith(self.path)
        return path == self.path or path.startswith(self.path + "/")


def _split(url: str) -> SplitResult | None:
    try:
        parts = urlsplit(url)
        _ = parts.port  # a port that is no number is a ValueError here, not later
    except ValueError:
        return None
    return parts


def check_url(url: str, prefixes: Sequence[SourcePrefix]) -> SourceRefusal | None:
    """Why one URL an agent would fetch is not admitted (None: it is): unreadable, a dot
    segment, or under none of `prefixes`."""
    parts = _split(url)
    if parts is None:
        return SourceRefusal.INVALID
    if has_dot_segment(parts.path):
        return SourceRefusal.DOT_SEGMENT
    scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
    port = parts.port if parts.port is not None else DEFAULT_PORTS.get(scheme, 0)
    if not any(prefix.covers(scheme, host, port, parts.path) for prefix in prefixes):
        return SourceRefusal.NOT_COVERED
    return None


def source_file_urls(uri: str) -> tuple[str, ...]:
    """The URLs of the adapter files under the directory URL `uri` (config first)."""
    base = uri.rstrip("/")
    return tuple(f"{base}/{name}" for name in ADAPTER_FILES)


def check_http_source(uri: str, prefixes: Sequence[SourcePrefix]) -> SourceRefusal | None:
    """Why an http(s) source is not admitted under `prefixes` (None: it is): unreadable, with a
    userinfo, a query or fragment (even an empty one), or a file URL `check_url` refuses."""
    parts = _split(uri)
    if parts is None:
        return SourceRefusal.INVALID
    if "@" in parts.netloc or userinfo_span(uri) is not None:
        return SourceRefusal.CREDENTIALS
    if "?" in uri or "#" in uri:
        return SourceRefusal.NOT_A_DIRECTORY
    for url in source_file_urls(uri):
        refusal = check_url(url, prefixes)
        if refusal is not None:
            return refusal
    return None
