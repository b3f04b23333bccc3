"""http(s) downloads: an adapter's two files fetched into a fresh private directory of the cache.

An http(s) source is a directory URL without userinfo, query or fragment under an allowed
prefix (`lorafleet_common.sources.check_http_source`, the rule the operator applies too): the
agent fetches ``<base>/adapter_config.json`` and ``<base>/adapter_model.safetensors`` separately
(no archive format to unpack, so no archive traversal to defend against), under a size cap,
hashing the weights while they stream, through checked connections (`connections`). A download
has an overall deadline and a minimum transfer rate (`watchdog`), a per-operation socket
timeout, and at most ``max_concurrent_downloads`` run at once per cache directory (beyond:
`TooManyDownloads`). A credential goes to the source's own URLs only, as an unredirected header.

No message repeats downloaded content: a downloaded ``adapter_config.json`` is checked here
(the engine's `read_adapter_config`) and a refusal names only the field; a weights file that is
not safetensors-shaped is refused without quoting it; HTTP reason phrases, malformed status
lines and redirect targets of refused redirects are not repeated.
"""

from __future__ import annotations

import http
import logging
import os
import re
import shutil
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.client import HTTPException, HTTPMessage, HTTPResponse
from pathlib import Path
from typing import IO

from lorafleet_common.sources import ADAPTER_CONFIG, ADAPTER_WEIGHTS, check_http_source, redact_uri, source_file_urls
from node_agent.engine import ADAPTER_CONFIG_FIELDS, AdapterLoadError, read_adapter_config
from node_agent.errors import AgentError, SourceNotFound, SourceRefused, SourceUnavailable, TooManyDownloads
from node_agent.sources.connections import HttpOnlyRedirects, build_opener
from node_agent.sources.copies import CHUNK_BYTES, DOWNLOAD_PREFIX, MAX_CONFIG_BYTES, HashedWriter, ResolvedSource, Written, private_dir
from node_agent.sources.credentials import SourceCredential
from node_agent.sources.policy import SourcePolicy, check_allowed, refusal_error
from node_agent.sources.watchdog import Watchdog

log = logging.getLogger(__name__)

COMMIT_HEADER = "X-Repo-Commit"  # the commit the Hub resolved a revision to
_MAX_SAFETENSORS_HEADER = 100_000_000  # safetensors' own limit on the header's length
# A refusal of a downloaded config names the first of the engine's config fields its message mentions.
_CONFIG_FIELD = re.compile(r"(?<![\w.])(" + "|".join(sorted(ADAPTER_CONFIG_FIELDS, key=len, reverse=True)) + r")(?![\w])")


class DownloadProgress:
    """The bytes one source's download has received, and the sizes its server declared so far;
    written by the downloading thread, read by others (ListAdapters) while it runs. `cancelled`
    says whether the load it is for was cancelled (its call ended): the download then stops."""

    def __init__(self, cancelled: Callable[[], bool] = lambda: False) -> None:
        self.cancelled = cancelled
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


@dataclass(frozen=True)
class Download:
    """One source's download: how it is shown, the policy over it, the credential sent to its
    own URLs, and where its bytes are counted."""

    shown: str
    policy: SourcePolicy
    credential: SourceCredential | None = None
    progress: DownloadProgress | None = None


@dataclass(frozen=True)
class Fetched:
    """A downloaded adapter directory, what was written into it, and the commit the first
    file's answers named (the Hub's ``X-Repo-Commit``; None when none did)."""

    directory: Path
    weights: Written
    config: Written
    commit: str | None


def download_http(uri: str, download: Download) -> ResolvedSource:
    """A private copy of the adapter under the directory URL `uri`."""
    refusal = check_http_source(uri, download.policy.prefixes)
    if refusal is not None:
        raise refusal_error(refusal, f"the source {download.shown!r}", download.policy.prefixes)
    config_url, weights_url = source_file_urls(uri)
    fetched = fetch_adapter(download, config_url, lambda _: weights_url)
    return ResolvedSource.of_copy(uri, fetched.directory, fetched.weights, fetched.config, downloaded=True)


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


@contextmanager
def fetching(download: Download) -> Iterator[Fetcher]:
    """One source's download: a concurrency slot, a fresh private directory (removed if the block
    fails), a watchdog and a checked opener, through which the block fetches its files."""
    policy = download.policy
    if policy.cache_dir is None:
        raise SourceRefused("remote sources (http(s), hf://, s3://, oci://) are refused: the agent has no --cache-dir", "no_cache_dir")
    with _download_slot(policy):
        target = private_dir(policy, DOWNLOAD_PREFIX)
        try:
            with Watchdog(policy, download.progress.cancelled if download.progress else lambda: False) as watchdog:
                redirects = HttpOnlyRedirects(policy.prefixes)
                yield Fetcher(build_opener(watchdog, policy.networks, redirects), watchdog, download, target, answers=redirects.hops)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
    log.debug("downloaded %s into %s", download.shown, target)


@contextmanager
def probing(download: Download) -> Iterator[Fetcher]:
    """`fetching` for a look at a source that keeps no copy (the revision it resolves to): the
    same slot, checks and watchdog; the directory (a manifest, a token's answer) is removed
    when the block ends."""
    with fetching(download) as fetcher:
        try:
            yield fetcher
        finally:
            shutil.rmtree(fetcher.directory, ignore_errors=True)


def fetch_adapter(download: Download, config_url: str, weights_url: Callable[[str | None], str]) -> Fetched:
    """Download both files into a fresh private directory, under every http(s) check: the config
    first, then the weights at `weights_url(commit)` (commit: the first X-Repo-Commit the
    config's answers carried, or None), itself checked against the allowed prefixes. The caller
    has checked the URLs it knows in advance."""
    policy, shown = download.policy, download.shown
    with fetching(download) as fetcher:
        target = fetcher.directory
        config = fetcher.fetch(config_url, target / ADAPTER_CONFIG, MAX_CONFIG_BYTES)
        check_downloaded_config(target, shown)
        commit = next((h[COMMIT_HEADER] for h in fetcher.answers if h.get(COMMIT_HEADER)), None)
        url = weights_url(commit)
        check_allowed(url, policy.prefixes, what=f"the source {shown!r}")
        weights = fetcher.fetch(url, target / ADAPTER_WEIGHTS, policy.max_download_bytes)
        check_downloaded_weights(target / ADAPTER_WEIGHTS, shown)
    return Fetched(target, weights, config, commit)


def check_downloaded_config(directory: Path, shown: str) -> None:
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


def check_downloaded_weights(path: Path, shown: str) -> None:
    """Refuse a download that is not shaped like safetensors (an 8-byte header length that fits the
    file, then a JSON object) before a rank reads it, without repeating any of its bytes."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        prefix = handle.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        first = handle.read(1) if 0 < length <= min(_MAX_SAFETENSORS_HEADER, size - 8) else b""
    if first != b"{":
        raise SourceRefused(f"{ADAPTER_WEIGHTS} downloaded from {shown} is not a safetensors file", "bad_adapter_weights")


@dataclass(frozen=True)
class Fetcher:
    """Fetches the files of one download into its private `directory`, through its opener,
    watched by its watchdog."""

    opener: urllib.request.OpenerDirector
    watchdog: Watchdog
    download: Download
    directory: Path
    answers: list[HTTPMessage] = field(default_factory=list)  # every final answer's headers are added, errors' too

    def fetch(self, url: str, dest: Path, cap: int, headers: Mapping[str, str] | None = None) -> Written:
        """Stream `url` into `dest`, refusing more than `cap` bytes; returns what was written (the
        final answer's headers: ``answers[-1]``). The credential and `headers` (a request's
        signature, a registry's token) go to `url` alone, as unredirected headers."""
        with self._answer("GET", url, headers) as response, open(dest, "xb") as out:
            return self._stream(response, out, cap, redact_uri(url))

    def head(self, url: str, cap: int, headers: Mapping[str, str] | None = None) -> HTTPMessage:
        """The headers of `url`'s answer to a HEAD request (no body is fetched), sent as `fetch`
        sends its GET; an answer that declares more than `cap` bytes is refused as its
        download would be."""
        with self._answer("HEAD", url, headers) as response:
            _declared_size(response, cap, redact_uri(url))
            return response.headers

    @contextmanager
    def _answer(self, method: str, url: str, headers: Mapping[str, str] | None) -> Iterator[HTTPResponse]:
        """The answer to one request (its headers added to `answers`, a refusal's too); HTTP and
        connection failures, also while the block reads the body, as the agent's errors."""
        shown = redact_uri(url)
        request = urllib.request.Request(url, headers={"User-Agent": "lorafleet-agent"}, method=method)
        for name, value in (headers or {}).items():
            request.add_unredirected_header(name, value)
        if self.download.credential is not None:
            request.add_unredirected_header("Authorization", self.download.credential.authorization)
        try:
            # The deadline is the watchdog's: the socket timeout bounds one operation only.
            with self.opener.open(request, timeout=self.download.policy.download_socket_timeout_s) as response:
                self.answers.append(response.headers)
                yield response
        except urllib.error.HTTPError as error:
            if isinstance(error.headers, HTTPMessage):  # a refusal's headers too: a registry's challenge
                self.answers.append(error.headers)
            raise _http_failure(error.code, shown) from None
        except (HTTPException, urllib.error.URLError, OSError) as error:
            self.watchdog.check(shown)
            raise _connection_failure(error, shown) from None

    def _stream(self, response: HTTPResponse, out: IO[bytes], cap: int, shown: str) -> Written:
        """The body into `out` under `cap` (declared or not), counted, the whole declared length."""
        declared = _declared_size(response, cap, shown)
        progress = self.download.progress
        if progress is not None and declared is not None:
            progress.expect(declared)
        writer, total = HashedWriter(out), 0
        while chunk := response.read1(CHUNK_BYTES):
            total += len(chunk)
            self.watchdog.count(len(chunk))
            if progress is not None:
                progress.count(len(chunk))
            if total > cap:  # a server may omit or understate Content-Length
                raise SourceRefused(f"{shown} exceeds the {cap}-byte cap", "too_large")
            writer.write(chunk)
        self.watchdog.check(shown)
        if declared is not None and total != declared:
            raise SourceUnavailable(f"download of {shown} failed: the body ended after {total} of {declared} bytes (truncated)")
        return writer.done()


def _declared_size(response: HTTPResponse, cap: int, shown: str) -> int | None:
    """The answer's declared length (None when it declares none), refused over `cap`."""
    declared_text = response.headers.get("Content-Length")
    declared = int(declared_text) if declared_text and declared_text.isdigit() else None
    if declared is not None and declared > cap:
        raise SourceRefused(f"{shown} is {declared} bytes, over the {cap}-byte cap", "too_large")
    return declared


def _reason_phrase(code: int) -> str:
    """The standard phrase of an HTTP status (the server's own phrase is its content: not repeated)."""
    try:
        return http.HTTPStatus(code).phrase
    except ValueError:
        return ""


def _http_failure(code: int, shown: str) -> AgentError:
    """An HTTP error status as the agent's error, with the standard phrase only."""
    status = f"HTTP {code} {_reason_phrase(code)}".rstrip()
    if code in (404, 410):
        return SourceNotFound(f"{shown} not found (HTTP {code})")
    if 300 <= code < 400:  # urllib itself refuses redirects to file:// with an HTTPError
        return SourceRefused(f"redirect from {shown} refused: {status} (http(s) only)", "redirect")
    if code >= 500:
        return SourceUnavailable(f"download of {shown} failed: {status}")
    return SourceRefused(f"download of {shown} refused: {status}", "http_error")


def _connection_failure(error: Exception, shown: str) -> SourceUnavailable:
    """A connection or protocol failure; an HTTPException's text may quote the server's bytes (a
    bad status line): only its kind is named."""
    reason = error if isinstance(error, HTTPException) else getattr(error, "reason", error)
    if isinstance(reason, HTTPException):
        return SourceUnavailable(f"download of {shown} failed: the reply is not valid HTTP ({type(reason).__name__})")
    return SourceUnavailable(f"download of {shown} failed: {reason}")
