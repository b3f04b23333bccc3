"""The repository's images built locally, without any registry, cached by content.

1. A base root filesystem from Debian's packages (``mmdebstrap --variant=minbase`` with
   python3 and python3-venv: Debian 12's Python is 3.11, what the Containerfile needs), cached
   as ``base-<key>.tar`` where the key hashes the suite, mirror and package list.
2. The two images, ``buildah bud --layers --target operator`` and ``--target agent`` of the
   repository's ``Containerfile`` with ``BASE`` naming that root filesystem, each in a buildah
   storage of its own kept between builds (``buildah-<target>`` beside the archives, the base
   committed into it once). Each image is a dependency layer and a code layer; the dependency
   layer (the agent's is gigabytes: torch, triton, the CUDA libraries) comes from buildah's
   layer cache while the dependency set is unchanged, so a code change rebuilds only the code
   layer. Each is written as a docker-archive ``<target>-<key>.tar``. The operator's key hashes
   the base key, the Containerfile, ``.dockerignore`` and its sources (:data:`OPERATOR_SOURCES`:
   never ``node_agent/``, which its stages do not copy); the agent's every file of the build
   context. Older images leave a storage once a newer one is built there; older archives leave
   the cache once unused for a while.

Archives live under ``${LORAFLEET_CACHE:-~/.cache/lorafleet}/images/``; a second build with
the same inputs returns the cached archive at once. :meth:`RealNode.import_image
<lorafleet_dev.node.RealNode.import_image>` loads one into the node's containerd;
:meth:`ImageBuilder.run_in_image` runs a command in a container of one (the agent image's
compiler test).

The build's ``RUN pip install`` steps reach the package index the way this machine's pip does:
``/etc/pip.conf`` and the system CA bundle are mounted into the build containers when present
(not into the images).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lorafleet_dev.checkout import Checkout
from lorafleet_dev.mounts import unmount_all
from lorafleet_dev.processes import HarnessError

log = logging.getLogger(__name__)

BASE_SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "passwd")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
#: Host files lent to the build's RUN steps so pip inside reaches the index pip here reaches.
BUILD_MOUNTS = (Path("/etc/pip.conf"), Path("/etc/ssl/certs/ca-certificates.crt"))
#: What the Containerfile's operator stages copy (tests/kube/test_image.py keeps them equal): the
#: operator image's content key hashes only these, so an edit under node_agent/ reuses it.
OPERATOR_SOURCES = ("pyproject.toml", "README.md", "proto", "common", "operator")
#: Skipped when hashing the build context (.dockerignore keeps them out of it too).
_NOT_CONTEXT = ("__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache")


@dataclass(frozen=True)
class BuiltImage:
    """An image archive ready for ``ctr images import``, and the name it carries."""

    name: str
    archive: Path


def cache_root() -> Path:
    """``${LORAFLEET_CACHE:-~/.cache/lorafleet}``: the image archives and the real node's image
    store (:func:`lorafleet_dev.node.store_dir`) live under it."""
    return Path(os.environ.get("LORAFLEET_CACHE", Path.home() / ".cache" / "lorafleet"))


def cache_dir() -> Path:
    """Where image archives are cached (created if missing)."""
    path = cache_root() / "images"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock next to ``path``: a concurrent build of it waits for this one."""
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _run(argv: list[str], what: str, log_path: Path) -> None:
    """Run a build step with its output appended to ``log_path``; raise with its tail."""
    with log_path.open("ab") as out:
        proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise HarnessError(f"{what} failed (exit {proc.returncode}, log {log_path}):\n{tail}")


def _context_roots(checkout: Checkout) -> list[str]:
    """What .dockerignore lets into the build context: its ``!path`` lines (the file says ``*``
    first, then re-includes what the images are built from)."""
    ignore = (checkout.root / ".dockerignore").read_text().splitlines()
    return [line[1:].strip().rstrip("/") for line in ignore if line.startswith("!")]


def _context_files(checkout: Checkout, roots: list[str]) -> list[Path]:
    """The files under ``roots`` (paths in the checkout), caches left out."""
    files = []
    for name in roots:
        top = checkout.root / name
        candidates = [top] if top.is_file() else sorted(top.rglob("*"))
        files += [p for p in candidates if p.is_file() and not any(part in _NOT_CONTEXT for part in p.parts) and p.suffix != ".pyc"]
    return files


def _digest(parts: list[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


#: Operator archives unused this long are pruned when another one is used.
PRUNE_AFTER_S = 3600.0
#: Agent archives are gigabytes each, and every edit of the build context makes a new one: one
#: unused for this long goes when another is used. Long enough for a session that has just been
#: handed one to open it for import (a deleted archive already open reads on).
AGENT_PRUNE_AFTER_S = 300.0


def _prune(keep: Path, unused_s: float) -> None:
    """Touch ``keep`` (its mtime is its last use) and remove archives of the same image unused
    for ``unused_s`` (each is hundreds of MB or more; the sources moved on). Recently used ones
    stay: another test session may be about to import one; so do partial archives (a build in
    progress). Lock files are rewritten on each use, so an old one is unused too."""
    os.utime(keep)
    prefix = keep.name.split("-", 1)[0] + "-"
    cutoff = time.time() - unused_s
    for old in keep.parent.glob(f"{prefix}*"):
        finished = old.name.endswith((".log", ".lock")) or (old.name.endswith(".tar") and not old.name.endswith(".partial.tar"))
        with contextlib.suppress(FileNotFoundError):
            if finished and not old.name.startswith(keep.stem + ".") and old.stat().st_mtime < cutoff:
                old.unlink()


def _buildah(storage: Path) -> list[str]:
    """The buildah command line for a storage of our own (nothing lands in the machine's)."""
    return ["buildah", f"--root={storage / 'root'}", f"--runroot={storage / 'run'}", "--storage-driver=overlay"]


def _image_exists(buildah: list[str], name: str) -> bool:
    return subprocess.run([*buildah, "inspect", "--type=image", name], capture_output=True, check=False).returncode == 0


def _image_names(buildah: list[str], repository: str) -> list[str]:
    """Tagged images of ``repository`` in a storage. Every image is listed and filtered here:
    ``buildah images REPOSITORY`` (buildah 1.28) looks for ``REPOSITORY:latest`` alone, finds no
    image and lists none, so older images never left the storage."""
    proc = subprocess.run([*buildah, "images", "--noheading", "--format={{.Name}}:{{.Tag}}"], capture_output=True, text=True, check=False)
    return [line for line in proc.stdout.split() if line.startswith(repository + ":")]


@dataclass(frozen=True)
class ImageBuilder:
    """Builds (or finds cached) the base root filesystem, the operator and the agent image."""

    checkout: Checkout
    mirror: str = DEFAULT_MIRROR

    def base_key(self) -> str:
        """Content key of the base root filesystem."""
        return _digest([json.dumps({"suite": BASE_SUITE, "mirror": self.mirror, "packages": BASE_PACKAGES, "variant": "minbase"}).encode()])

    def base_rootfs(self) -> Path:
        """The base root filesystem tar (mmdebstrap, about a minute on a cold cache)."""
        path = cache_dir() / f"base-{self.base_key()}.tar"
        with _locked(path):
            if path.exists():
                return path
            started = time.monotonic()
            partial = path.with_suffix(".partial.tar")
            _run(
                [
                    "mmdebstrap",
                    "--quiet",
                    "--variant=minbase",
                    f"--include={','.join(BASE_PACKAGES)}",
                    BASE_SUITE,
                    str(partial),
                    self.mirror,
                ],
                "mmdebstrap of the base root filesystem",
                path.with_suffix(".log"),
            )
            partial.rename(path)
            log.info("built base root filesystem %s in %.0fs", path.name, time.monotonic() - started)
        return path

    def operator_key(self) -> str:
        """Content key of the operator image: the base and every input of its build."""
        return self._key(list(OPERATOR_SOURCES))

    def agent_key(self) -> str:
        """Content key of the agent image: the base and the whole build context."""
        return self._key(_context_roots(self.checkout))

    def _key(self, sources: list[str]) -> str:
        root = self.checkout.root
        inputs = [root / "Containerfile", root / ".dockerignore", *_context_files(self.checkout, sources)]
        return _digest([self.base_key().encode()] + [str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() for p in inputs])

    def operator_image(self) -> BuiltImage:
        """The operator image (Containerfile target ``operator``), built if not cached."""
        return self._layered_image("operator", self.operator_key(), PRUNE_AFTER_S)

    def agent_image(self) -> BuiltImage:
        """The agent image (Containerfile target ``agent``), built if not cached (minutes cold:
        pip downloads gigabytes)."""
        return self._layered_image("agent", self.agent_key(), AGENT_PRUNE_AFTER_S)

    def _layered_image(self, target: str, key: str, prune_after_s: float) -> BuiltImage:
        """Build ``target`` with ``--layers`` in the storage kept for it (its dependency layer
        from buildah's layer cache while the dependency set is unchanged) unless its archive
        for ``key`` exists; older images of it leave that storage, older archives the cache."""
        repository = f"localhost/lorafleet-{target}"
        image = BuiltImage(f"{repository}:{key}", cache_dir() / f"{target}-{key}.tar")
        storage = cache_dir() / f"buildah-{target}"
        with _locked(image.archive):
            if not image.archive.exists():
                base = self.base_rootfs()
                started = time.monotonic()
                # One build at a time in a storage (buildah locks it too, but two builds would
                # each pay for the dependency layer).
                with _locked(storage):
                    try:
                        self._buildah_build(storage, base, target, image)
                    finally:
                        _forget_other_images(storage, repository, keep=image.name)
                log.info("built %s in %.0fs", image.name, time.monotonic() - started)
            _prune(image.archive, prune_after_s)
        return image

    def run_in_image(self, image: BuiltImage, argv: list[str], user: str = "65532:65532") -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in a throw-away container of ``image`` (``buildah run``, chroot
        isolation, the image's environment, as ``user``: the image's own by default), its output
        captured and its exit status returned, not raised. The container comes from the storage
        the image was built in, taken in again from its archive if a newer build has dropped it."""
        storage = cache_dir() / f"buildah-{image.archive.name.split('-', 1)[0]}"
        buildah = _buildah(storage)
        with _locked(storage):
            if not _image_exists(buildah, image.name):
                _run(
                    [*buildah, "pull", f"docker-archive:{image.archive}"], "buildah pull of the archive", image.archive.with_suffix(".log")
                )
            container = subprocess.run(
                [*buildah, "from", "--pull-never", image.name], capture_output=True, text=True, check=True
            ).stdout.strip()
            try:
                return subprocess.run(
                    [*buildah, "run", "--isolation=chroot", f"--user={user}", container, "--", *argv],
                    capture_output=True,
                    text=True,
                    check=False,
                )
            finally:
                subprocess.run([*buildah, "rm", container], capture_output=True, check=False)
                unmount_all(storage)

    def _buildah_build(self, storage: Path, base: Path, target: str, image: BuiltImage) -> None:
        if shutil.which("buildah") is None:
            raise HarnessError("buildah is missing (scripts/build-node.sh installs it)")
        log_path = image.archive.with_suffix(".log")
        log_path.unlink(missing_ok=True)
        buildah = _buildah(storage)
        base_name = f"localhost/lorafleet-base:{self.base_key()}"
        partial = image.archive.with_suffix(".partial.tar")
        try:
            # Committed once per storage: a second commit of the same tar would be a new image
            # and miss every cached layer above it.
            if not _image_exists(buildah, base_name):
                container = subprocess.run([*buildah, "from", "scratch"], capture_output=True, text=True, check=True).stdout.strip()
                _run([*buildah, "add", container, str(base), "/"], "buildah add of the base", log_path)
                _run([*buildah, "commit", "--rm", container, base_name], "buildah commit of the base", log_path)
            mounts = [f"--volume={p}:{p}:ro" for p in BUILD_MOUNTS if p.exists()]
            _run(
                [
                    *buildah,
                    "bud",
                    "--isolation=chroot",
                    "--network=host",
                    "--layers=true",
                    *mounts,
                    f"--build-arg=BASE={base_name}",
                    f"--target={target}",
                    f"--tag={image.name}",
                    f"--file={self.checkout.root / 'Containerfile'}",
                    str(self.checkout.root),
                ],
                f"buildah bud --target {target}",
                log_path,
            )
            partial.unlink(missing_ok=True)
            _run([*buildah, "push", image.name, f"docker-archive:{partial}:{image.name}"], "buildah push to a docker-archive", log_path)
            partial.rename(image.archive)
        finally:
            with contextlib.suppress(OSError):
                partial.unlink()


def _forget_other_images(storage: Path, repository: str, keep: str) -> None:
    """Untag every other image of ``repository`` and prune what no tagged image needs: an old
    dependency layer goes once no image is built on it; the current one stays, as the parent of
    ``keep``. Build containers and their mounts go too."""
    buildah = _buildah(storage)
    subprocess.run([*buildah, "rm", "--all"], capture_output=True, check=False)
    for name in _image_names(buildah, repository):
        if name != keep:
            subprocess.run([*buildah, "rmi", name], capture_output=True, check=False)
    subprocess.run([*buildah, "rmi", "--prune"], capture_output=True, check=False)
    unmount_all(storage)
