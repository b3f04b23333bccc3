"""Adapter sources: from a LoadAdapter URI to a private local copy of the adapter the ranks read.

Policy (docs/agent.md "Sources" and "Limits"):

* ``file:///absolute/dir`` — only under a configured adapter root. Refused: relative paths,
  a host (``file://host/...``; only ``localhost`` is accepted), any ``..`` component (also
  percent-encoded), and any symlink whose target leaves the roots. The path is walked from the
  root one component at a time through directory file descriptors opened with ``O_NOFOLLOW``:
  the kernel never follows a symlink by itself; a symlink met on the way is read and resolved by
  the walk, and followed only while it stays inside a root (Kubernetes volumes are built from
  such links). The two adapter files are opened the same way (``O_NONBLOCK``: a FIFO is refused,
  not waited on), read once into an agent-private snapshot directory (mode 0700, in the cache
  directory or the system temp directory) and hashed while copied. The ranks load the snapshot,
  so the bytes that were checked and hashed are exactly the bytes every rank reads, whatever
  happens under the root meanwhile.
* ``http(s)://`` only under a configured source prefix (``allowed_sources``, ``--allow-source``;
  none: http(s) refused), checked for the URL as given and for every redirect hop; a path with
  a ``.``/``..`` segment (also percent-encoded) is refused. Every connection resolves its host
  once, checks every address of the answer, and connects only to an address it checked (the
  connection's ``create_connection`` does all three, so nothing can change in between; TLS SNI
  and ``Host`` keep the name). Loopback, link-local (cloud metadata), private, shared
  (100.64.0.0/10), unspecified, multicast and other non-global addresses are never connected to
  unless they lie in ``allowed_networks`` (``--allow-source-network``). Environment proxies are
  not used (through a proxy the agent could not check where it connects).
* ``http(s)://host/base`` — a directory-like URL without userinfo, query or fragment: the agent
  fetches ``<base>/adapter_config.json`` and ``<base>/adapter_model.safetensors`` separately (no
  archive format to unpack, so no archive traversal to defend against) into a fresh private
  directory of the cache, under a size cap, hashing the weights while they stream; redirects
  only to http(s). A download has an overall deadline and a minimum transfer rate (a watchdog
  shuts its socket down when either is broken), a per-operation socket timeout, and at most
  ``max_concurrent_downloads`` run at once per cache directory (beyond: `TooManyDownloads`).
* ``hf://ORG/REPO[@REVISION][/SUBDIR]`` — a Hub repository (`node_agent.hub`): the two files
  at one commit (a branch or tag is pinned to the commit the Hub names for the first file),
  from ``hub_endpoint`` (``--hub-endpoint``, the fleet owner's), through the same downloader and
  checks as http(s).
* A source credential (`SourceCredential`: LoadAdapterRequest.source_token as ``Authorization:
  Bearer``, or source_basic as ``Authorization: Basic``) is sent to the source's own URLs only,
  as an unredirected header (never to a redirect target, such as the Hub's file CDN), and never
  logged or repeated; a value that cannot be a header is refused without showing it.
* Any other scheme is refused, and so are credentials (``user:password@``) in any URI; no
  message or log line of this module repeats a URI's userinfo or query (`redact_uri`).
* No message repeats downloaded content: a downloaded ``adapter_config.json`` is checked here
  (`read_adapter_config`) and a refusal names only the field; a weights file that is not
  safetensors-shaped is refused without quoting it; HTTP reason phrases, malformed status lines
  and redirect targets of refused redirects are not repeated.

Only those two files are ever read by the agent, and the engine reads only safetensors weights:
no pickle is ever opened. The sha256 of the weights file is always computed (it is what
ListAdapters reports and what "same content" compares) and checked against the request's
sha256 when one is given. Snapshots and downloads are owned by their `ResolvedSource` and
removed by `discard()`.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import errno
import functools
import hashlib
import http
import ipaddress
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.client import HTTPConnection, HTTPException, HTTPMessage, HTTPResponse, HTTPSConnection
from pathlib import Path, PurePosixPath
from typing import IO, Any
from urllib.parse import unquote, urlsplit

from node_agent.engine import (
    ADAPTER_CONFIG_FIELDS,
    AdapterLoadError,
    FileDigests,
    FileIdentity,
    WrittenFiles,
    read_adapter_config,
)
from node_agent.errors import InvalidRequest, SourceNotFound, SourceRefused, SourceUnavailable, TooManyDownloads
from node_agent.hub import COMMIT_HEADER, DEFAULT_HUB_ENDPOINT, parse_hub_uri, pinned_commit

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
DEFAULT_MAX_DOWNLOAD_BYTES = 4 << 30
DEFAULT_DOWNLOAD_TIMEOUT_S = 600.0
DEFAULT_DOWNLOAD_MIN_BYTES_PER_S = 64 << 10
DEFAULT_DOWNLOAD_RATE_WINDOW_S = 10.0
DEFAULT_SOCKET_TIMEOUT_S = 30.0
DEFAULT_MAX_CONCURRENT_DOWNLOADS = 8
CHUNK_BYTES = 1 << 20
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
DOWNLOAD_PREFIX = "dl-"
SNAPSHOT_PREFIX = "snap-"
MAX_SYMLINKS = 40  # symlinks followed while walking one path (the kernel's own limit)
# Everything between "//" and the next "/": a userinfo is anything up to the last "@" in there
# (also when it holds a raw "?" or "#", which urlsplit would cut the netloc at).
_AUTHORITY = re.compile(r"^(?:[A-Za-z][A-Za-z0-9+.-]*:)?//(?P<authority>[^/]*)")
ALLOW_SOURCE_FLAG = "--allow-source"
ALLOW_NETWORK_FLAG = "--allow-source-network"
_DEFAULT_PORTS = {"http": 80, "https": 443}
_ANY_PORT = -1
_MAX_SAFETENSORS_HEADER = 100_000_000  # safetensors' own limit on the header's length
# A refusal of a downloaded config names the first of the engine's config fields its message mentions.
_CONFIG_FIELD = re.compile(r"(?<![\w.])(" + "|".join(sorted(ADAPTER_CONFIG_FIELDS, key=len, reverse=True)) + r")(?![\w])")


@dataclass(frozen=True)
class SourcePrefix:
    """One ``--allow-source`` entry: http(s) URLs under it may be fetched.

    ``scheme://host[:port]/path``: the scheme and host must be equal (case-insensitive), the port
    equal (none given: the scheme's default; ``:*``: any port), and the URL's path must equal
    the prefix's path or continue it after a ``/`` (``https://h/org`` covers ``https://h/org/x``,
    not ``https://h/organisation``).
    """

    scheme: str
    host: str
    port: int  # _ANY_PORT: any
    path: str

    @classmethod
    def parse(cls, text: str) -> SourcePrefix:
        any_port = re.sub(r"^([A-Za-z]+://[^/]*):\*(?=/|$)", r"\1", text)
        try:
            parts = urlsplit(any_port)
            port = parts.port
        except ValueError as error:
            raise ValueError(f"{ALLOW_SOURCE_FLAG} {text!r} is not a valid URL prefix: {error}") from None
        scheme = parts.scheme.lower()
        if scheme not in _DEFAULT_PORTS or not parts.hostname:
            raise ValueError(f"{ALLOW_SOURCE_FLAG} {text!r} must be an http:// or https:// URL with a host, e.g. https://huggingface.co/")
        if "@" in parts.netloc or parts.query or parts.fragment or "?" in text or "#" in text:
            raise ValueError(f"{ALLOW_SOURCE_FLAG} {redact_uri(text)!r} must not have credentials, a query or a fragment")
        if _has_dot_segment(parts.path):
            raise ValueError(f"{ALLOW_SOURCE_FLAG} {text!r} must not have '.' or '..' path segments")
        resolved_port = _ANY_PORT if any_port != text else port if port is not None else _DEFAULT_PORTS[scheme]
        return cls(scheme, parts.hostname.lower(), resolved_port, parts.path or "/")

    def covers(self, scheme: str, host: str, port: int, path: str) -> bool:
        if (scheme, host) != (self.scheme, self.host) or self.port not in (_ANY_PORT, port):
            return False
        path = path or "/"
        if self.path.endswith("/"):
            return path.startswith(self.path)
        return path == self.path or path.startswith(self.path + "/")


def _has_dot_segment(path: str) -> bool:
    """Whether a URL path has a ``.`` or ``..`` segment, also percent-encoded or after a backslash."""
    return any(segment in (".", "..") for segment in re.split(r"[/\\]", unquote(path)))


@functools.lru_cache(maxsize=64)
def _prefixes(entries: tuple[str, ...]) -> tuple[SourcePrefix, ...]:
    return tuple(SourcePrefix.parse(entry) for entry in entries)


@functools.lru_cache(maxsize=64)
def _networks(entries: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    networks = []
    for entry in entries:
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ValueError(f"{ALLOW_NETWORK_FLAG} {entry!r} is not an IP network (CIDR such as 127.0.0.1/32 or 10.0.0.0/8)") from None
    return tuple(networks)


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

    def __post_init__(self) -> None:
        _prefixes(tuple(self.allowed_sources))  # ValueError naming the flag and the entry
        _networks(tuple(self.allowed_networks))
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


# What identifies an adapter's content: the digests of its two files, in the engine's own record
# of them, so what a source verified compares directly with what each rank reports it read.
Content = FileDigests


@dataclass(frozen=True)
class _Written:
    """A file the agent wrote: the sha256 of every byte written, and its identity after the last."""

    sha256: str
    identity: FileIdentity


class _HashedWriter:
    """Writes a new file of a snapshot or a download and hashes the same bytes on the way."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out, self.digest = out, hashlib.sha256()

    def write(self, chunk: bytes) -> None:
        self.digest.update(chunk)
        self.out.write(chunk)

    def done(self) -> _Written:
        """The digest, and the identity taken through the descriptor once every byte is out (a
        stat by path could name another file by then)."""
        self.out.flush()
        return _Written(self.digest.hexdigest(), FileIdentity.of(os.fstat(self.out.fileno())))


def _content(weights: _Written, config: _Written) -> tuple[Content, WrittenFiles]:
    return Content(weights.sha256, config.sha256), WrittenFiles(weights.identity, config.identity)


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
    revision: str = ""  # hf:// sources: the commit both files were fetched at
    # The files' identities once written and hashed: the engine need not hash them again.
    written: WrittenFiles | None = None

    def discard(self) -> None:
        """Remove the agent's private copy (downloads and snapshots)."""
        if self.downloaded or self.owned:
            shutil.rmtree(self.path, ignore_errors=True)


def parse_sha256(value: str) -> str | None:
    """The request's optional sha256 (empty = none), normalised to lowercase hex."""
    if not value:
        return None
    normalised = value.strip().lower()
    if not SHA256_HEX.match(normalised):
        raise InvalidRequest(f"sha256 must be 64 hex digits, got {value!r}")
    return normalised


def _userinfo_span(uri: str) -> tuple[int, int] | None:
    """Where a URI's userinfo (``user:password@``) is, if it has one."""
    match = _AUTHORITY.match(uri)
    if match is None or "@" not in match.group("authority"):
        return None
    start = match.start("authority")
    return start, start + match.group("authority").rindex("@") + 1


def redact_uri(uri: str) -> str:
    """`uri` safe for messages and logs: userinfo becomes ``***@``, a query or fragment ``?<redacted>``."""
    span = _userinfo_span(uri)
    shown = uri if span is None else uri[: span[0]] + "***@" + uri[span[1] :]
    cut = min((i for i in (shown.find("?"), shown.find("#")) if i >= 0), default=-1)
    return shown if cut < 0 else shown[:cut] + "?<redacted>"


@dataclass(frozen=True)
class SourceCredential:
    """What authenticates a download: the ``Authorization`` header value sent to the source's own
    URLs. Its repr shows only the scheme, so no log line or traceback can carry the secret."""

    authorization: str

    def __repr__(self) -> str:
        return f"SourceCredential({self.authorization.partition(' ')[0]} ***)"

    @classmethod
    def bearer(cls, token: str) -> SourceCredential:
        """A bearer token (a Hub token, or any http(s) bearer token)."""
        _check_header_safe(token, "the source token")
        return cls(f"Bearer {token}")

    @classmethod
    def basic(cls, username: str, password: str) -> SourceCredential:
        """HTTP basic authentication (RFC 7617): a user name without ':' and a password."""
        if ":" in username:
            raise InvalidRequest("the source user name cannot contain ':' (HTTP basic authentication)")
        _check_header_safe(username, "the source user name")
        _check_header_safe(password, "the source password")
        return cls("Basic " + base64.b64encode(f"{username}:{password}".encode()).decode("ascii"))


def _check_header_safe(value: str, what: str) -> None:
    """Refuse an empty value or one with control or non-ASCII characters, without showing it
    (http.client would refuse it with the value in its message)."""
    if not value:
        raise InvalidRequest(f"{what} is empty")
    bad = sum(1 for c in value if not " " <= c <= "~")
    if bad:
        raise InvalidRequest(f"{what} cannot be sent as a header value: it contains {bad} control or non-ASCII character(s)")


class DownloadProgress:
    """The bytes one source's download has received, and the sizes its server declared so far;
    written by the downloading thread, read by others (ListAdapters) while it runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = 0
        self._total = 0

    def expect(self, size: int) -> None:
        """A file's declared size (Content-Length) joins the total."""
        with self._lock:
            self._total += size

    def count(self, size: int) -> None:
        with self._lock:
            self._done += size

    def snapshot(self) -> tuple[int, int]:
        """(bytes received, bytes declared so far)."""
        with self._lock:
            return self._done, self._total


def resolve_source(
    uri: str,
    expected_sha256: str | None,
    policy: SourcePolicy,
    credential: SourceCredential | None = None,
    progress: DownloadProgress | None = None,
) -> ResolvedSource:
    """Check `uri` against the policy and make a private copy of its adapter. A `credential`
    (http(s) and hf:// sources) is sent to the source's own URLs only: never on a redirect, never
    logged or repeated in a message; a file:// source with one is refused. A download counts its
    bytes into `progress`."""
    shown = redact_uri(uri)
    try:
        parts = urlsplit(uri)
    except ValueError as error:
        raise SourceRefused(f"source URI {shown!r} is not a valid URI: {error}", "bad_uri") from None
    scheme = parts.scheme.lower()
    if "@" in parts.netloc or _userinfo_span(uri) is not None:
        raise SourceRefused(
            f"credentials in source URIs are refused ({shown!r}): the agent never sends or logs "
            "URL userinfo; serve the adapter without them",
            "credentials",
        )
    if scheme == "file" and credential is not None:
        raise SourceRefused(f"file:// sources take no credential ({shown!r})", "credentials")
    if scheme == "file":
        source = _resolve_file(uri, shown, parts.netloc, parts.path, parts.query or parts.fragment, policy)
    elif scheme in ("http", "https"):
        source = _download(uri, shown, parts.query or parts.fragment, policy, credential, progress)
    elif scheme == "hf":
        source = _download_hub(uri, shown, policy, credential, progress)
    else:
        raise SourceRefused(f"source scheme {scheme or '(none)'!r} is refused in {shown!r}: use file://, http(s):// or hf://", "scheme")
    if expected_sha256 is not None and source.content.weights_sha256 != expected_sha256:
        source.discard()
        raise SourceRefused(
            f"sha256 mismatch for {shown}: {ADAPTER_WEIGHTS} has {source.content.weights_sha256}, expected {expected_sha256}",
            "sha256_mismatch",
        )
    return source


def clean_cache(cache_dir: Path) -> None:
    """Remove downloads and snapshots left by an earlier process (a fresh agent holds no adapters)."""
    for prefix in (DOWNLOAD_PREFIX, SNAPSHOT_PREFIX):
        for stale in Path(cache_dir).glob(f"{prefix}*"):
            shutil.rmtree(stale, ignore_errors=True)


def _private_dir(policy: SourcePolicy, prefix: str) -> Path:
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


# -- file:// -----------------------------------------------------------------------------------


def _resolve_file(uri: str, shown: str, host: str, raw_path: str, extra: str, policy: SourcePolicy) -> ResolvedSource:
    path = unquote(raw_path)
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
    if not policy.adapter_roots:
        raise SourceRefused("file:// sources are refused: the agent has no --adapter-root", "outside_roots")
    roots = [(os.path.abspath(root), os.path.realpath(root)) for root in policy.adapter_roots]
    with _Beneath(roots, shown) as beneath:
        start = beneath.locate(os.path.normpath(path))
        if start is None:
            raise SourceRefused(f"{shown!r} is outside the adapter roots ({', '.join(r for r, _ in roots)})", "outside_roots")
        directory = beneath.walk(
            [beneath.root_fd(start[0])],
            start[1],
            want_dir=True,
            missing=f"adapter directory {shown!r} does not exist",
        )
        files = {}
        for name, cap in ((ADAPTER_CONFIG, MAX_CONFIG_BYTES), (ADAPTER_WEIGHTS, policy.max_download_bytes)):
            fd = beneath.walk(
                directory,
                [name],
                want_dir=False,
                missing=f"{name} not found in {shown!r} (only safetensors adapters are served; pickle files are never read)",
            )[-1]
            size = os.fstat(fd).st_size
            if size > cap:
                raise SourceRefused(f"{name} in {shown!r} is {size} bytes, over the {cap}-byte cap", "too_large")
            files[name] = (fd, cap)
        snapshot = _private_dir(policy, SNAPSHOT_PREFIX)
        try:
            written = {name: _copy_fd(fd, snapshot / name, cap, f"{name} in {shown!r}") for name, (fd, cap) in files.items()}
        except BaseException:
            shutil.rmtree(snapshot, ignore_errors=True)
            raise
    log.debug("snapshotted %s into %s", shown, snapshot)
    content, identities = _content(written[ADAPTER_WEIGHTS], written[ADAPTER_CONFIG])
    return ResolvedSource(uri, snapshot, content, owned=True, written=identities)


def _copy_fd(fd: int, dest: Path, cap: int, what: str) -> _Written:
    """Copy an open file into `dest` (never more than `cap` bytes); what was written."""
    total = 0
    try:
        with open(dest, "xb") as out:
            writer = _HashedWriter(out)
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
        if index not in self._root_fds:
            real = self.roots[index][1]
            try:
                self._root_fds[index] = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as error:
                raise SourceNotFound(f"adapter root {real} cannot be opened ({error.strerror}) for {self.shown!r}") from None
        return self._root_fds[index]

    def walk(self, start: list[int], parts: list[str], want_dir: bool, missing: str) -> list[int]:
        """Open `parts` below the directory stack `start`; the new stack's fds stay open until exit."""
        stack = [os.dup(fd) for fd in start]
        pending = collections.deque(parts)
        links = 0
        try:
            while pending:
                name = pending.popleft()
                if name in ("", "."):
                    continue
                if name == "..":
                    if len(stack) == 1:
                        raise SourceRefused(f"{self.shown!r} leads through a symlink above its adapter root", "symlink_escape")
                    os.close(stack.pop())
                    continue
                directory = want_dir or bool(pending)
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | (os.O_DIRECTORY if directory else 0)
                try:
                    fd = os.open(name, flags, dir_fd=stack[-1])
                except OSError as error:
                    links += 1
                    if links > MAX_SYMLINKS:
                        raise SourceRefused(
                            f"{self.shown!r}: too many symlinks (or a path changing under the walk)", "symlink_loop"
                        ) from None
                    target = self._classify(stack[-1], name, directory, error, missing)
                    if target is None:  # the entry changed between open and lstat: look again
                        pending.appendleft(name)
                    elif os.path.isabs(target):
                        found = self.locate(os.path.normpath(target))
                        if found is None:
                            raise SourceRefused(
                                f"{name!r} in {self.shown!r} is a symlink to {target}, outside the adapter roots", "symlink_escape"
                            ) from None
                        for held in stack:
                            os.close(held)
                        stack = [os.dup(self.root_fd(found[0]))]
                        pending.extendleft(reversed(found[1]))
                    else:
                        pending.extendleft(reversed(PurePosixPath(target).parts))
                    continue
                stack.append(fd)
                if not directory and not stat.S_ISREG(mode := os.fstat(fd).st_mode):
                    raise SourceRefused(f"{name!r} in {self.shown!r} is {_kind(mode)}, not a regular file", "not_a_file")
            self._held.extend(stack)
            return stack
        except BaseException:
            for held in stack:
                os.close(held)
            raise

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


# -- http(s):// --------------------------------------------------------------------------------


class _Watchdog:
    """Enforces one source's overall deadline and minimum rate by shutting its sockets down.

    Socket timeouts bound single operations only; a server that trickles a byte now and then
    never trips them. The watchdog thread ticks, and once the deadline passes or fewer than the
    minimum bytes per second arrived over the last window, it records why and shuts down every
    socket of the download, which ends the blocked read at once.
    """

    def __init__(self, policy: SourcePolicy) -> None:
        self.deadline_s = policy.download_timeout_s
        self.min_rate = policy.download_min_bytes_per_s
        self.window_s = policy.download_rate_window_s
        self.started = time.monotonic()
        self.received = 0
        self.failure: str | None = None
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="download-watchdog", daemon=True)

    def __enter__(self) -> _Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            if self.failure is not None:
                _shutdown(sock)

    def count(self, n: int) -> None:
        with self._lock:
            self.received += n

    def _run(self) -> None:
        tick = min(0.25, self.window_s / 4)
        samples: collections.deque[tuple[float, int]] = collections.deque([(self.started, 0)])
        while not self._done.wait(tick):
            now = time.monotonic()
            with self._lock:
                received = self.received
            samples.append((now, received))
            while len(samples) > 1 and now - samples[1][0] >= self.window_s:
                samples.popleft()
            if now - self.started >= self.deadline_s:
                self._fire(f"did not finish within the {self.deadline_s:g}-s download deadline ({received} bytes received)")
            elif now - samples[0][0] >= self.window_s:
                rate = (received - samples[0][1]) / (now - samples[0][0])
                if rate < self.min_rate:
                    self._fire(
                        f"is too slow: {rate:.0f} bytes/s over the last {now - samples[0][0]:.1f} s, "
                        f"under the minimum of {self.min_rate} bytes/s"
                    )
            if self.failure is not None:
                return

    def _fire(self, why: str) -> None:
        with self._lock:
            self.failure = why
            for sock in self._sockets:
                _shutdown(sock)


def _shutdown(sock: socket.socket) -> None:
    # the plain socket's shutdown, also for TLS sockets (it ends a read blocked in another thread)
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


_SHARED_NETWORK = ipaddress.ip_network("100.64.0.0/10")


def _address_class(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """What kind of non-public address `ip` is (None: a global unicast address)."""
    for test, name in (
        ("is_unspecified", "unspecified"),
        ("is_loopback", "loopback"),
        ("is_link_local", "link-local (where cloud metadata services answer)"),
        ("is_multicast", "multicast"),
        ("is_site_local", "site-local"),
    ):
        if getattr(ip, test, False):
            return name
    if ip in _SHARED_NETWORK:
        return "shared (100.64.0.0/10, carrier-grade NAT)"
    if ip.is_private:
        return "private"
    if not ip.is_global:
        return "reserved (not globally routable)"
    return None


def _connect_checked(
    address: tuple[str, int],
    timeout: float | None = None,
    source_address: tuple[str, int] | None = None,
    *,
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...],
) -> socket.socket:
    """`socket.create_connection`, but only to addresses the policy allows.

    The host is resolved once; every address of the answer is checked; only checked addresses
    are connected to (in the resolver's order), so no second lookup can answer differently.
    """
    host, port = address
    answers = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    allowed, refused = [], []
    for family, kind, proto, _, sockaddr in answers:
        ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:  # ::ffff:a.b.c.d is a.b.c.d
            ip = ip.ipv4_mapped
        why = _address_class(ip)
        if why is not None and not any(ip.version == net.version and ip in net for net in networks):
            refused.append((ip, why))
        else:
            allowed.append((family, kind, proto, sockaddr))
    if refused:
        log.warning("download host %s: not connecting to %s", host, ", ".join(f"{ip} ({why})" for ip, why in refused))
    if not allowed:
        kinds = ", ".join(sorted({why for _, why in refused}))
        raise SourceRefused(
            f"the host {host!r} resolves only to addresses downloads may not connect to ({kinds}); "
            f"allow such networks with {ALLOW_NETWORK_FLAG} CIDR",
            "address_refused",
        )
    error: OSError | None = None
    for family, kind, proto, sockaddr in allowed:
        sock = socket.socket(family, kind, proto)
        try:
            if timeout is not None:
                sock.settimeout(timeout)
            if source_address:
                sock.bind(source_address)
            sock.connect(sockaddr)
            return sock
        except OSError as failed:
            sock.close()
            error = failed
    assert error is not None
    raise error


class _TrackedHTTPConnection(HTTPConnection):
    """A connection to checked addresses only (`_connect_checked`) that hands its socket to the
    watchdog once connected. The host name stays the connection's: ``Host`` and TLS SNI use it."""

    def __init__(self, *args: Any, watchdog: _Watchdog, networks: tuple[Any, ...], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._watchdog = watchdog
        self._create_connection = functools.partial(_connect_checked, networks=networks)

    def connect(self) -> None:
        super().connect()
        self._watchdog.track(self.sock)


class _TrackedHTTPSConnection(_TrackedHTTPConnection, HTTPSConnection):
    """The same over TLS: in this order `super()` above is HTTPSConnection, so the watchdog
    tracks the TLS socket, after the handshake (wrapping detaches the plain socket)."""


class _TrackedHandler(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
    """http and https through tracked connections; being both, it replaces both default handlers."""

    def __init__(self, watchdog: _Watchdog, networks: tuple[Any, ...]) -> None:
        super().__init__()
        self._http = functools.partial(_TrackedHTTPConnection, watchdog=watchdog, networks=networks)
        self._https = functools.partial(_TrackedHTTPSConnection, watchdog=watchdog, networks=networks)

    def http_open(self, req: urllib.request.Request) -> HTTPResponse:
        return self.do_open(self._http, req)

    def https_open(self, req: urllib.request.Request) -> HTTPResponse:
        return self.do_open(self._https, req)


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follow redirects only to http(s) URLs without credentials (urllib allows ftp:// and file://)
    and under an allowed source prefix; the target is not repeated (it is the server's content)."""

    def __init__(self, prefixes: tuple[SourcePrefix, ...]) -> None:
        super().__init__()
        self._prefixes = prefixes
        self.hops: list[HTTPMessage] = []  # the headers of every redirect answered (the Hub's commit)

    def redirect_request(
        self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str, headers: HTTPMessage, newurl: str
    ) -> urllib.request.Request | None:
        try:
            target = urlsplit(newurl)
        except ValueError:
            target = urlsplit("invalid:")
        what = f"redirect from {redact_uri(req.full_url)} refused"
        if target.scheme.lower() not in ("http", "https"):
            raise SourceRefused(f"{what}: the target is not an http(s) URL", "redirect")
        if "@" in target.netloc:
            raise SourceRefused(f"{what}: credentials in URLs are refused", "redirect")
        _check_allowed(newurl, self._prefixes, what=f"{what}: the target")
        self.hops.append(headers)
        # The token was added as an unredirected header: urllib does not carry it to the target.
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _check_allowed(url: str, prefixes: tuple[SourcePrefix, ...], what: str) -> None:
    """Refuse `url` unless an allowed source prefix covers it (and its path has no dot segment)."""
    if not prefixes:
        raise SourceRefused(
            f"{what} is refused: this agent allows no http(s) sources; the fleet's owner names the URL prefixes "
            f"agents may fetch from with {ALLOW_SOURCE_FLAG} PREFIX (e.g. https://huggingface.co/)",
            "source_not_allowed",
        )
    try:
        parts = urlsplit(url)
        scheme, host, port = parts.scheme.lower(), (parts.hostname or "").lower(), parts.port
    except ValueError:
        raise SourceRefused(f"{what} is not a valid URL", "bad_uri") from None
    if _has_dot_segment(parts.path):
        raise SourceRefused(f"'.' and '..' path segments are refused in http(s) URLs: {what}", "traversal")
    port = port if port is not None else _DEFAULT_PORTS.get(scheme, 0)
    if not any(prefix.covers(scheme, host, port, parts.path) for prefix in prefixes):
        raise SourceRefused(f"{what} is not under any source prefix this agent allows ({ALLOW_SOURCE_FLAG})", "source_not_allowed")


_ACTIVE_DOWNLOADS: dict[str, int] = {}
_ACTIVE_LOCK = threading.Lock()


@contextmanager
def _download_slot(policy: SourcePolicy) -> Iterator[None]:
    """One of the cache directory's `max_concurrent_downloads` places, or TooManyDownloads at once."""
    key = os.path.abspath(str(policy.cache_dir))
    limit = policy.max_concurrent_downloads
    with _ACTIVE_LOCK:
        running = _ACTIVE_DOWNLOADS.get(key, 0)
        if running >= limit:
            raise TooManyDownloads(
                f"too many concurrent downloads: {running} running, the limit is {limit} (--max-concurrent-downloads); retry later"
            )
        _ACTIVE_DOWNLOADS[key] = running + 1
    try:
        yield
    finally:
        with _ACTIVE_LOCK:
            _ACTIVE_DOWNLOADS[key] -= 1
            if not _ACTIVE_DOWNLOADS[key]:
                del _ACTIVE_DOWNLOADS[key]


def _download(
    uri: str, shown: str, extra: str, policy: SourcePolicy, credential: SourceCredential | None, progress: DownloadProgress | None
) -> ResolvedSource:
    if extra:
        raise SourceRefused(f"http(s) sources are directory URLs without query or fragment: {shown!r}", "bad_uri")
    base = uri.rstrip("/")
    target, written, _ = _fetch_adapter(
        shown, policy, credential, f"{base}/{ADAPTER_CONFIG}", lambda _: f"{base}/{ADAPTER_WEIGHTS}", progress=progress
    )
    content, identities = _content(*written)
    return ResolvedSource(uri, target, content, downloaded=True, owned=True, written=identities)


def _download_hub(
    uri: str, shown: str, policy: SourcePolicy, credential: SourceCredential | None, progress: DownloadProgress | None
) -> ResolvedSource:
    hub = parse_hub_uri(uri, shown)
    endpoint = policy.hub_endpoint

    def weights_url(answered: str | None) -> str:
        return hub.file_url(endpoint, ADAPTER_WEIGHTS, pinned_commit(hub, answered, shown))

    target, written, commit = _fetch_adapter(
        shown,
        policy,
        credential,
        hub.file_url(endpoint, ADAPTER_CONFIG),
        weights_url,
        also_allowed=hub.file_url(endpoint, ADAPTER_WEIGHTS),
        progress=progress,
    )
    log.debug("downloaded %s (%s at commit %s) into %s", shown, hub.repo_id, commit or hub.revision, target)
    content, identities = _content(*written)
    return ResolvedSource(uri, target, content, downloaded=True, owned=True, revision=pinned_commit(hub, commit, shown), written=identities)


def _fetch_adapter(
    shown: str,
    policy: SourcePolicy,
    credential: SourceCredential | None,
    config_url: str,
    weights_url: Callable[[str | None], str],
    also_allowed: str | None = None,
    progress: DownloadProgress | None = None,
) -> tuple[Path, tuple[_Written, _Written], str | None]:
    """Download both files into a fresh private directory, under every http(s) check: the config
    first, then the weights at `weights_url(commit)` (commit: the first X-Repo-Commit the config's
    answers carried, or None). Returns the directory, what was written (weights, config) and that
    commit."""
    prefixes = _prefixes(tuple(policy.allowed_sources))
    for url in (config_url, also_allowed or weights_url(None)):
        _check_allowed(url, prefixes, what=f"the source {shown!r}")
    if policy.cache_dir is None:
        raise SourceRefused("http(s) and hf:// sources are refused: the agent has no --cache-dir", "no_cache_dir")
    networks = _networks(tuple(policy.allowed_networks))
    with _download_slot(policy):
        target = _private_dir(policy, DOWNLOAD_PREFIX)
        try:
            with _Watchdog(policy) as watchdog:
                redirects = _HttpOnlyRedirects(prefixes)
                # No ProxyHandler with environment proxies: every connection is the agent's own, checked.
                opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _TrackedHandler(watchdog, networks), redirects)
                fetch = functools.partial(
                    _fetch,
                    opener=opener,
                    watchdog=watchdog,
                    socket_timeout_s=policy.download_socket_timeout_s,
                    credential=credential,
                    answers=redirects.hops,
                    progress=progress,
                )
                config = fetch(config_url, target / ADAPTER_CONFIG, MAX_CONFIG_BYTES)
                _check_downloaded_config(target, shown)
                commit = next((h[COMMIT_HEADER] for h in redirects.hops if h.get(COMMIT_HEADER)), None)
                url = weights_url(commit)
                _check_allowed(url, prefixes, what=f"the source {shown!r}")
                weights = fetch(url, target / ADAPTER_WEIGHTS, policy.max_download_bytes)
                _check_downloaded_weights(target / ADAPTER_WEIGHTS, shown)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
    log.debug("downloaded %s into %s", shown, target)
    return target, (weights, config), commit


def _check_downloaded_config(directory: Path, shown: str) -> None:
    """The engine's checks of adapter_config.json, run on the download; a refusal names the field
    (the first top-level field the check's message mentions), never a value read from the file."""
    try:
        read_adapter_config(directory)
    except AdapterLoadError as error:
        found = _CONFIG_FIELD.search(str(error).replace(str(directory), ""))  # the agent's own path is no field
        problem = f"its field {found.group(1)!r} is invalid or not supported" if found else "it is not a valid LoRA adapter config"
        raise SourceRefused(
            f"{ADAPTER_CONFIG} downloaded from {shown} is refused: {problem} (values read from downloaded files are "
            "never repeated in messages)",
            "bad_adapter_config",
        ) from None


def _check_downloaded_weights(path: Path, shown: str) -> None:
    """Refuse a download that is not shaped like safetensors (an 8-byte header length that fits the
    file, then a JSON object) before a rank reads it, without repeating any of its bytes."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        prefix = handle.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        first = handle.read(1) if 0 < length <= min(_MAX_SAFETENSORS_HEADER, size - 8) else b""
    if first != b"{":
        raise SourceRefused(f"{ADAPTER_WEIGHTS} downloaded from {shown} is not a safetensors file", "bad_adapter_weights")


def _reason_phrase(code: int) -> str:
    """The standard phrase of an HTTP status (the server's own phrase is its content: not repeated)."""
    try:
        return http.HTTPStatus(code).phrase
    except ValueError:
        return ""


def _fetch(
    url: str,
    dest: Path,
    cap: int,
    *,
    opener: urllib.request.OpenerDirector,
    watchdog: _Watchdog,
    socket_timeout_s: float,
    credential: SourceCredential | None = None,
    answers: list[HTTPMessage] | None = None,
    progress: DownloadProgress | None = None,
) -> _Written:
    """Stream `url` into `dest`, refusing more than `cap` bytes; returns what was written. `credential`
    goes to `url` alone (an unredirected header); the final answer's headers are added to `answers`."""
    shown = redact_uri(url)
    request = urllib.request.Request(url, headers={"User-Agent": "lorafleet-agent"})
    if credential is not None:
        request.add_unredirected_header("Authorization", credential.authorization)
    try:
        # The deadline is the watchdog's: the socket timeout bounds one operation only.
        with opener.open(request, timeout=socket_timeout_s) as response, open(dest, "xb") as out:
            if answers is not None:
                answers.append(response.headers)
            declared_text = response.headers.get("Content-Length")
            declared = int(declared_text) if declared_text and declared_text.isdigit() else None
            if declared is not None and declared > cap:
                raise SourceRefused(f"{shown} is {declared} bytes, over the {cap}-byte cap", "too_large")
            if progress is not None and declared is not None:
                progress.expect(declared)
            writer, total = _HashedWriter(out), 0
            while chunk := response.read1(CHUNK_BYTES):
                total += len(chunk)
                watchdog.count(len(chunk))
                if progress is not None:
                    progress.count(len(chunk))
                if total > cap:  # a server may omit or understate Content-Length
                    raise SourceRefused(f"{shown} exceeds the {cap}-byte cap", "too_large")
                writer.write(chunk)
            _check_watchdog(watchdog, shown)
            if declared is not None and total != declared:
                raise SourceUnavailable(f"download of {shown} failed: the body ended after {total} of {declared} bytes (truncated)")
            return writer.done()
    except urllib.error.HTTPError as error:
        status = f"HTTP {error.code} {_reason_phrase(error.code)}".rstrip()
        if error.code in (404, 410):
            raise SourceNotFound(f"{shown} not found (HTTP {error.code})") from None
        if 300 <= error.code < 400:  # urllib itself refuses redirects to file:// with an HTTPError
            raise SourceRefused(f"redirect from {shown} refused: {status} (http(s) only)", "redirect") from None
        if error.code >= 500:
            raise SourceUnavailable(f"download of {shown} failed: {status}") from None
        raise SourceRefused(f"download of {shown} refused: {status}", "http_error") from None
    except HTTPException as error:  # its text may quote the server's bytes (a bad status line): only its kind
        _check_watchdog(watchdog, shown)
        raise SourceUnavailable(f"download of {shown} failed: the reply is not valid HTTP ({type(error).__name__})") from None
    except (urllib.error.URLError, OSError) as error:
        _check_watchdog(watchdog, shown)
        reason = getattr(error, "reason", error)
        if isinstance(reason, HTTPException):
            raise SourceUnavailable(f"download of {shown} failed: the reply is not valid HTTP ({type(reason).__name__})") from None
        raise SourceUnavailable(f"download of {shown} failed: {reason}") from None


def _check_watchdog(watchdog: _Watchdog, shown: str) -> None:
    failure = watchdog.failure
    if failure is None and time.monotonic() - watchdog.started >= watchdog.deadline_s:  # before the watchdog's tick
        failure = f"did not finish within the {watchdog.deadline_s:g}-s download deadline"
    if failure is not None:
        raise SourceUnavailable(f"download of {shown} {failure}")
