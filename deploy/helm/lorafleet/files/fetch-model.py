"""Download the agents' base model: the chart's fetch-model init container (agent image).

Environment: MODEL_URL (http(s) URL of a .tar / .tar.gz / .tgz archive of the model directory),
MODEL_SHA256 (the archive's sha256, required), MODEL_DIR (the emptyDir the agent mounts as
--model), MODEL_ALLOW_HTTP ("1" accepts plaintext http), MODEL_TIMEOUT_S (overall deadline).

The checks follow the agent's adapter sources (node_agent/sources/): http(s) only, no
credentials, query or fragment in the URL, redirects only to such URLs, the digest computed
while the bytes stream and compared before anything is unpacked. The archive may hold only
regular files and directories (no links, devices, absolute paths or `..`), with config.json at
its root or inside its one top-level directory. A marker file records the digest, so a
restarted pod whose emptyDir survived does not download again. Exit status 1 with one line on
stderr on any failure (the kubelet retries the init container).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tarfile
import time
import urllib.parse
import urllib.request
from pathlib import Path, PurePosixPath

MARKER = ".lorafleet-model-sha256"
CHUNK = 1 << 20
SOCKET_TIMEOUT_S = 30.0


class Refused(Exception):
    """The download or the archive is not acceptable; the message says why."""


def redact(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = f"***@{host}" if "@" in parts.netloc else parts.netloc
    query = "?<redacted>" if parts.query else ""
    return f"{parts.scheme}://{netloc}{parts.path}{query}"


def check_url(url: str, allow_http: bool) -> None:
    parts = urllib.parse.urlsplit(url)
    schemes = ("https", "http") if allow_http else ("https",)
    if parts.scheme not in schemes:
        hint = "" if allow_http or parts.scheme != "http" else " (agent.model.download.allowHttp=true accepts http)"
        raise Refused(f"{redact(url)}: the scheme must be {' or '.join(schemes)}{hint}")
    if "@" in parts.netloc:
        raise Refused(f"{redact(url)}: credentials in a URL are refused")
    if parts.query or parts.fragment:
        raise Refused(f"{redact(url)}: a query or fragment is refused")
    if not parts.hostname:
        raise Refused(f"{redact(url)}: no host")


class CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to a URL that passes the same checks."""

    def __init__(self, allow_http: bool) -> None:
        self.allow_http = allow_http

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        check_url(newurl, self.allow_http)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def download(url: str, dest: Path, allow_http: bool, deadline: float) -> str:
    """Stream ``url`` into ``dest``; return the sha256 of the bytes written."""
    opener = urllib.request.build_opener(CheckedRedirects(allow_http))
    digest = hashlib.sha256()
    try:
        with opener.open(url, timeout=SOCKET_TIMEOUT_S) as resp, dest.open("wb") as out:
            expected = resp.headers.get("Content-Length")
            written = 0
            while chunk := resp.read(CHUNK):
                if time.monotonic() > deadline:
                    raise Refused(f"{redact(url)}: the download did not finish within its deadline")
                digest.update(chunk)
                out.write(chunk)
                written += len(chunk)
            if expected is not None and written != int(expected):
                raise Refused(f"{redact(url)}: truncated ({written} of {expected} bytes)")
    except OSError as exc:  # URLError and HTTPError are OSErrors
        raise Refused(f"{redact(url)}: download failed: {exc}") from None
    return digest.hexdigest()


def checked_members(tar: tarfile.TarFile) -> list[tarfile.TarInfo]:
    """The archive's members when each is a regular file or a directory inside the model
    directory, with no setuid, setgid or sticky bit and no group or other write permission.
    Checked here, not only by tarfile's "data" filter: Python 3.11 before 3.11.4 (Debian 12's
    3.11.2, the image's base in the tests) has no extraction filters."""
    members = tar.getmembers()
    for member in members:
        if not (member.isfile() or member.isdir()):
            raise Refused(f"the archive's {member.name!r} is not a regular file or directory")
        name = PurePosixPath(member.name)
        if name.is_absolute() or ".." in name.parts:
            raise Refused(f"the archive's {member.name!r} lies outside the model directory")
        member.mode &= 0o755
    return members


def unpack(archive: Path, into: Path) -> None:
    """Extract regular files and directories only, then move the model directory's entries up."""
    staging = into / ".unpack"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    # tarfile's own "data" filter on top where this Python has it.
    extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    try:
        with tarfile.open(archive, "r:*") as tar:
            tar.extractall(staging, members=checked_members(tar), **extra)
    except (tarfile.TarError, OSError) as exc:
        raise Refused(f"the archive cannot be unpacked: {exc}") from None
    root = staging
    if not (root / "config.json").is_file():
        entries = list(staging.iterdir())
        if len(entries) == 1 and (entries[0] / "config.json").is_file():
            root = entries[0]
        else:
            raise Refused("the archive has no config.json at its root or in its one top-level directory")
    for entry in root.iterdir():
        entry.rename(into / entry.name)
    shutil.rmtree(staging)


def fetch(url: str, sha256: str, model_dir: Path, allow_http: bool, timeout_s: float) -> str:
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise Refused("MODEL_SHA256 must be 64 lowercase hex digits")
    check_url(url, allow_http)
    marker = model_dir / MARKER
    if marker.is_file() and marker.read_text().strip() == sha256:
        return f"model {sha256[:12]} already in {model_dir}"
    # Whatever an interrupted earlier attempt left goes first.
    for entry in model_dir.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    archive = model_dir / ".download"
    got = download(url, archive, allow_http, time.monotonic() + timeout_s)
    if got != sha256:
        archive.unlink()
        raise Refused(f"{redact(url)}: sha256 mismatch: the archive has {got}, agent.model.download.sha256 is {sha256}")
    unpack(archive, model_dir)
    archive.unlink()
    marker.write_text(sha256 + "\n")
    return f"model {sha256[:12]} from {redact(url)} unpacked into {model_dir}"


def main() -> int:
    env = os.environ
    try:
        message = fetch(
            env["MODEL_URL"],
            env["MODEL_SHA256"],
            Path(env["MODEL_DIR"]),
            env.get("MODEL_ALLOW_HTTP") == "1",
            float(env.get("MODEL_TIMEOUT_S", "3600")),
        )
    except Refused as exc:
        print(f"fetch-model: {exc}", file=sys.stderr)
        return 1
    except KeyError as exc:
        print(f"fetch-model: {exc.args[0]} is not set", file=sys.stderr)
        return 1
    print(f"fetch-model: {message}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
