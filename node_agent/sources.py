"""Adapter sources: from a LoadAdapter URI to a local PEFT adapter directory the ranks can read.

Policy (DESIGN.md §6):

* ``file:///absolute/dir`` — only under a configured adapter root. Refused: relative paths
  (``file:dir``, ``file://dir/...``, whose first segment URL syntax makes a host name), any ``..``
  component (also percent-encoded), a directory whose real path (symlinks resolved) leaves every
  root, and adapter files that are symlinks out of the roots. Symlinks that stay inside a root
  are fine (Kubernetes volumes are built from them).
* ``http(s)://host/base`` — a directory-like URL without query or fragment: the agent fetches
  ``<base>/adapter_config.json`` and ``<base>/adapter_model.safetensors`` separately (no archive
  format to unpack, so no archive traversal to defend against) into a fresh directory of the
  cache, under a size cap, hashing the weights while they stream; redirects only to http(s).
* Any other scheme is refused.

Only those two files are ever read by the agent, and the engine reads only safetensors weights:
no pickle is ever opened. The sha256 of the weights file is always computed (it is what
ListAdapters reports and what "same content" compares) and checked against the request's
sha256 when one is given.

The rank processes read the directory after these checks, so a root whose contents change in
between is not defended against: adapter roots are expected to be read-only volumes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from email.message import Message
from http.client import HTTPException
from pathlib import Path, PurePosixPath
from typing import BinaryIO
from urllib.parse import unquote, urlsplit

from node_agent.errors import InvalidRequest, SourceNotFound, SourceRefused, SourceUnavailable

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
DEFAULT_MAX_DOWNLOAD_BYTES = 4 << 30
CHUNK_BYTES = 1 << 20
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
DOWNLOAD_PREFIX = "dl-"


@dataclass(frozen=True)
class SourcePolicy:
    """Where adapters may come from and where downloads go."""

    adapter_roots: tuple[Path, ...] = ()
    cache_dir: Path | None = None
    max_download_bytes: int = DEFAULT_MAX_DOWNLOAD_BYTES  # cap on adapter_model.safetensors
    download_timeout_s: float = 60.0  # per socket operation, not for the whole download


@dataclass(frozen=True)
class Content:
    """What identifies an adapter's content: the digests of its two files."""

    weights_sha256: str
    config_sha256: str


@dataclass(frozen=True)
class ResolvedSource:
    """A checked local adapter directory; `downloaded` ones live in the cache and are owned."""

    uri: str
    path: Path
    content: Content
    downloaded: bool = False

    def discard(self) -> None:
        """Remove a downloaded copy (a no-op for file:// sources, which are never touched)."""
        if self.downloaded:
            shutil.rmtree(self.path, ignore_errors=True)


def parse_sha256(value: str) -> str | None:
    """The request's optional sha256 (empty = none), normalised to lowercase hex."""
    if not value:
        return None
    normalised = value.strip().lower()
    if not SHA256_HEX.match(normalised):
        raise InvalidRequest(f"sha256 must be 64 hex digits, got {value!r}")
    return normalised


def resolve_source(uri: str, expected_sha256: str | None, policy: SourcePolicy) -> ResolvedSource:
    """Check `uri` against the policy and make its adapter available locally."""
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme == "file":
        source = _resolve_file(uri, parts.netloc, parts.path, parts.query or parts.fragment, policy)
    elif scheme in ("http", "https"):
        source = _download(uri, parts.query or parts.fragment, policy)
    else:
        raise SourceRefused(f"source scheme {scheme or '(none)'!r} is refused in {uri!r}: use file:// or http(s)://", "scheme")
    if expected_sha256 is not None and source.content.weights_sha256 != expected_sha256:
        source.discard()
        raise SourceRefused(
            f"sha256 mismatch for {uri}: {ADAPTER_WEIGHTS} has {source.content.weights_sha256}, expected {expected_sha256}",
            "sha256_mismatch",
        )
    return source


def clean_cache(cache_dir: Path) -> None:
    """Remove downloads left by an earlier process (a fresh agent holds no adapters)."""
    for stale in Path(cache_dir).glob(f"{DOWNLOAD_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)


# -- file:// -----------------------------------------------------------------------------------


def _resolve_file(uri: str, host: str, raw_path: str, extra: str, policy: SourcePolicy) -> ResolvedSource:
    path = unquote(raw_path)
    if host not in ("", "localhost") or not path.startswith("/"):
        raise SourceRefused(f"relative path refused in {uri!r}: file URIs need an absolute path (file:///dir)", "relative_path")
    if extra or "\x00" in path:
        raise SourceRefused(f"file URI {uri!r} must be a plain path (no query, fragment or NUL)", "bad_uri")
    if ".." in PurePosixPath(path).parts:
        raise SourceRefused(f"'..' is refused in source paths: {uri!r}", "traversal")
    if not policy.adapter_roots:
        raise SourceRefused("file:// sources are refused: the agent has no --adapter-root", "outside_roots")
    roots = [os.path.abspath(root) for root in policy.adapter_roots]
    real_roots = [os.path.realpath(root) for root in roots]
    lexical = os.path.normpath(path)
    if not any(_within(lexical, root) for root in roots + real_roots):
        raise SourceRefused(f"{uri!r} is outside the adapter roots ({', '.join(roots)})", "outside_roots")
    real = os.path.realpath(lexical)
    if not any(_within(real, root) for root in real_roots):
        raise SourceRefused(f"{uri!r} resolves through a symlink to {real}, outside the adapter roots", "symlink_escape")
    if not os.path.isdir(real):
        raise SourceNotFound(f"adapter directory {uri!r} does not exist")
    digests = {}
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        file_real = os.path.realpath(os.path.join(real, name))
        if not any(_within(file_real, root) for root in real_roots):
            raise SourceRefused(f"{name} in {uri!r} is a symlink to {file_real}, outside the adapter roots", "symlink_escape")
        if not os.path.isfile(file_real):
            raise SourceNotFound(f"{name} not found in {uri!r} (only safetensors adapters are served; pickle files are never read)")
        with open(file_real, "rb") as handle:
            digests[name] = _sha256_of(handle)
    return ResolvedSource(uri, Path(real), Content(digests[ADAPTER_WEIGHTS], digests[ADAPTER_CONFIG]))


def _within(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _sha256_of(handle: BinaryIO) -> str:
    digest = hashlib.sha256()
    while chunk := handle.read(CHUNK_BYTES):
        digest.update(chunk)
    return digest.hexdigest()


# -- http(s):// --------------------------------------------------------------------------------


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follow redirects only to http(s): never to ftp:// or file:// (urllib allows ftp)."""

    def redirect_request(
        self, req: urllib.request.Request, fp: BinaryIO, code: int, msg: str, headers: Message, newurl: str
    ) -> urllib.request.Request | None:
        if urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise SourceRefused(f"redirect from {req.full_url} to {newurl!r} refused: http(s) only", "redirect")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_HttpOnlyRedirects)


def _download(uri: str, extra: str, policy: SourcePolicy) -> ResolvedSource:
    if extra:
        raise SourceRefused(f"http(s) sources are directory URLs without query or fragment: {uri!r}", "bad_uri")
    if policy.cache_dir is None:
        raise SourceRefused("http(s) sources are refused: the agent has no --cache-dir", "no_cache_dir")
    Path(policy.cache_dir).mkdir(parents=True, exist_ok=True)
    target = Path(tempfile.mkdtemp(prefix=DOWNLOAD_PREFIX, dir=policy.cache_dir))
    base = uri.rstrip("/")
    try:
        config_sha = _fetch(f"{base}/{ADAPTER_CONFIG}", target / ADAPTER_CONFIG, MAX_CONFIG_BYTES, policy.download_timeout_s)
        weights_sha = _fetch(f"{base}/{ADAPTER_WEIGHTS}", target / ADAPTER_WEIGHTS, policy.max_download_bytes, policy.download_timeout_s)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    log.debug("downloaded %s into %s", uri, target)
    return ResolvedSource(uri, target, Content(weights_sha, config_sha), downloaded=True)


def _fetch(url: str, dest: Path, cap: int, timeout_s: float) -> str:
    """Stream `url` into `dest`, refusing more than `cap` bytes; returns the sha256."""
    request = urllib.request.Request(url, headers={"User-Agent": "lorafleet-agent"})
    try:
        with _OPENER.open(request, timeout=timeout_s) as response, open(dest, "xb") as out:
            declared = response.headers.get("Content-Length")
            if declared and declared.isdigit() and int(declared) > cap:
                raise SourceRefused(f"{url} is {int(declared)} bytes, over the {cap}-byte cap", "too_large")
            digest, total = hashlib.sha256(), 0
            while chunk := response.read(CHUNK_BYTES):
                total += len(chunk)
                if total > cap:  # a server may omit or understate Content-Length
                    raise SourceRefused(f"{url} exceeds the {cap}-byte cap", "too_large")
                digest.update(chunk)
                out.write(chunk)
            return digest.hexdigest()
    except urllib.error.HTTPError as error:
        if error.code in (404, 410):
            raise SourceNotFound(f"{url} not found (HTTP {error.code})") from None
        if 300 <= error.code < 400:  # urllib itself refuses redirects to file:// with an HTTPError
            raise SourceRefused(f"redirect from {url} refused: {error.reason} (http(s) only)", "redirect") from None
        if error.code >= 500:
            raise SourceUnavailable(f"download of {url} failed: HTTP {error.code} {error.reason}") from None
        raise SourceRefused(f"download of {url} refused: HTTP {error.code} {error.reason}", "http_error") from None
    except (urllib.error.URLError, HTTPException, OSError) as error:
        reason = getattr(error, "reason", error)
        raise SourceUnavailable(f"download of {url} failed: {reason}") from None
