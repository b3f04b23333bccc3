"""OCI image archives written directly (no image builder): a tar of an OCI image layout with one
uncompressed layer, named by the ``io.containerd.image.name`` annotation that
``ctr images import`` reads. Enough for the node's pause image, which is one static binary.
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
import tarfile
from collections.abc import Mapping, Sequence
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


def write_image_archive(
    path: Path, name: str, files: Mapping[str, Path], *, entrypoint: Sequence[str]
) -> None:
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
            "architecture": arch, "os": "linux",
            "config": {"Entrypoint": list(entrypoint)},
            "rootfs": {"type": "layers", "diff_ids": [layer_desc["digest"]]},
        }
        config_desc = _blob(layout, json.dumps(config).encode(), CONFIG_TYPE)
        manifest = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "config": config_desc,
                    "layers": [layer_desc]}
        manifest_desc = _blob(layout, json.dumps(manifest).encode(), MANIFEST_TYPE)
        manifest_desc["platform"] = {"architecture": arch, "os": "linux"}
        manifest_desc["annotations"] = {"io.containerd.image.name": name,
                                        "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1]}
        index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                 "manifests": [manifest_desc]}
        _add(layout, "index.json", json.dumps(index).encode(), 0o644)
        _add(layout, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode(), 0o644)
