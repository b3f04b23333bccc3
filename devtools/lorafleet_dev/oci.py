"""OCI image archives written directly (no image builder): a tar of an OCI image layout with one
uncompressed layer, named by the ``io.containerd.image.name`` annotation that
``ctr images import`` reads. Enough for the node's pause image, which is one static binary.

:func:`read_archive_image` reads back what an archive (this kind, or a docker-archive as buildah
writes) holds: its name, config digest and layers' chain ID, which the node's image store
compares with what it already holds.
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"
_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}


def _blob(layout: tarfile.TarFile, data: bytes, media_type: str) -> dict[str, Any]:
    """Add ``data`` as a content-addressed blob; return its descriptor."""
    digest = hashlib.sha256(data).hexdigest()
    _add(layout, f"blobs/sha256/{digest}", data, 0o644)
    return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}


def _add(archive: tarfile.TarFile, name: str, data: bytes, mode: int) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    archive.addfile(info, io.BytesIO(data))


def write_image_archive(path: Path, name: str, files: Mapping[str, Path], *, entrypoint: Sequence[str]) -> None:
    """Write an image ``name`` (``repo:tag``) whose root filesystem holds ``files`` (path in
    the image -> file here, all executable, owned by root) to the OCI archive ``path``."""
    layer_buf = io.BytesIO()
    with tarfile.open(fileobj=layer_buf, mode="w", format=tarfile.PAX_FORMAT) as layer:
        for inner, source in sorted(files.items()):
            _add(layer, inner, source.read_bytes(), 0o755)
    layer_data = layer_buf.getvalue()
    arch = _ARCH.get(platform.machine(), platform.machine())
    with tarfile.open(path, mode="w", format=tarfile.PAX_FORMAT) as layout:
        layer_desc = _blob(layout, layer_data, LAYER_TYPE)
        config = {
            "architecture": arch,
            "os": "linux",
            "config": {"Entrypoint": list(entrypoint)},
            "rootfs": {"type": "layers", "diff_ids": [layer_desc["digest"]]},
        }
        config_desc = _blob(layout, json.dumps(config).encode(), CONFIG_TYPE)
        manifest = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "config": config_desc, "layers": [layer_desc]}
        manifest_desc = _blob(layout, json.dumps(manifest).encode(), MANIFEST_TYPE)
        manifest_desc["platform"] = {"architecture": arch, "os": "linux"}
        manifest_desc["annotations"] = {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1]}
        index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [manifest_desc]}
        _add(layout, "index.json", json.dumps(index).encode(), 0o644)
        _add(layout, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode(), 0o644)


@dataclass(frozen=True)
class ArchiveImage:
    """What an image archive holds: the name it is imported as, the digest of its config (the
    image's identity) and its layers' uncompressed digests (``rootfs.diff_ids``)."""

    name: str
    config_digest: str
    diff_ids: tuple[str, ...]

    @property
    def chain_id(self) -> str:
        """The OCI chain ID of the top layer: the key of the image's unpacked snapshot."""
        chain = self.diff_ids[0]
        for diff_id in self.diff_ids[1:]:
            chain = "sha256:" + hashlib.sha256(f"{chain} {diff_id}".encode()).hexdigest()
        return chain


def read_archive_image(path: Path) -> ArchiveImage:
    """The image of a docker-archive (``manifest.json``) or an OCI archive (``index.json``,
    named by the ``io.containerd.image.name`` annotation). Only the small members are read;
    the layers are skipped over (tarfile seeks past them)."""
    with tarfile.open(path, mode="r:") as archive:

        def member(name: str) -> bytes:
            file = archive.extractfile(name)
            if file is None:
                raise ValueError(f"{path}: {name} is not a file")
            return file.read()

        names = archive.getnames()
        if "manifest.json" in names:
            (entry,) = json.loads(member("manifest.json"))
            (name,) = entry["RepoTags"]
            config_bytes = member(entry["Config"])
        else:
            (manifest_desc,) = json.loads(member("index.json"))["manifests"]
            name = manifest_desc["annotations"]["io.containerd.image.name"]
            manifest = json.loads(member(_blob_path(manifest_desc["digest"])))
            config_bytes = member(_blob_path(manifest["config"]["digest"]))
    config = json.loads(config_bytes)
    return ArchiveImage(name, "sha256:" + hashlib.sha256(config_bytes).hexdigest(), tuple(config["rootfs"]["diff_ids"]))


def _blob_path(digest: str) -> str:
    algorithm, hex_digest = digest.split(":", 1)
    return f"blobs/{algorithm}/{hex_digest}"
