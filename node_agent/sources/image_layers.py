"""An adapter shipped as a container image (as KAITO ships adapters): its files read out of the
image's tar layers (gzip-compressed or plain), already held to their digests.

Only the two adapter files are ever written, under their own names in the private directory,
whatever folder of the layer holds them (KAITO's images keep them in ``/data``); nothing else of
a layer is written anywhere, so no member name can point outside. A member with either name must
be a regular file (no link, device or directory) under its cap, and each name may appear once
in all layers; a pickle file anywhere refuses the image. The uncompressed sizes of all members
together are bounded before they are read, so a compression bomb stops at its first header.
"""

from __future__ import annotations

import tarfile
import zlib
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from lorafleet_common.sources import ADAPTER_CONFIG, ADAPTER_FILES
from node_agent.errors import SourceRefused
from node_agent.sources.copies import CHUNK_BYTES, MAX_CONFIG_BYTES, HashedWriter, Written

IMAGE_LAYER_TYPES = (
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def unpack_adapter(directory: Path, archives: Sequence[Path], weights_cap: int, shown: str) -> dict[str, Written]:
    """The adapter's two files, read out of the layers `archives` (in order) into `directory`,
    each hashed as written; the archives are removed."""
    found: dict[str, Written] = {}
    budget = _Budget(weights_cap + MAX_CONFIG_BYTES, shown)
    for archive in archives:
        try:
            with tarfile.open(archive, "r:*") as layer:
                for member in layer:
                    budget.take(member.size)
                    name = _adapter_file(member, shown)
                    if name is not None:
                        found[name] = _write(layer, member, directory / name, found, weights_cap, shown)
        except (tarfile.TarError, EOFError, OSError, zlib.error):
            raise SourceRefused(f"a layer of the image {shown} is not a readable tar archive", "bad_layer") from None
        finally:
            archive.unlink(missing_ok=True)
    missing = [name for name in ADAPTER_FILES if name not in found]
    if missing:
        raise SourceRefused(f"the layers of the image {shown} hold no {' and no '.join(missing)}", "bad_manifest")
    return found


class _Budget:
    """The uncompressed bytes all members may hold together."""

    def __init__(self, total: int, shown: str) -> None:
        self.left, self.total, self.shown = total, total, shown

    def take(self, size: int) -> None:
        self.left -= size
        if self.left < 0:
            raise SourceRefused(f"the layers of the image {self.shown} unpack to more than {self.total} bytes", "too_large")


def _adapter_file(member: tarfile.TarInfo, shown: str) -> str | None:
    """Which adapter file `member` is (None: neither, and not read); refuses a pickle file and
    an adapter file's name on anything but a regular file."""
    name = PurePosixPath(member.name).name
    if name.lower().endswith(PICKLE_SUFFIXES):
        raise SourceRefused(f"the image {shown} holds a pickle file: only safetensors weights are ever read", "pickle")
    if name not in ADAPTER_FILES:
        return None
    if not member.isreg():
        raise SourceRefused(f"{name} in the image {shown} is not a regular file (a link or a device is refused)", "bad_layer")
    return name


def _write(layer: tarfile.TarFile, member: tarfile.TarInfo, dest: Path, found: dict[str, Written], weights_cap: int, shown: str) -> Written:
    """One adapter file out of the layer, under its cap, once."""
    if dest.name in found:
        raise SourceRefused(f"the image {shown} holds {dest.name} more than once", "bad_layer")
    cap = MAX_CONFIG_BYTES if dest.name == ADAPTER_CONFIG else weights_cap
    if member.size > cap:
        raise SourceRefused(f"{dest.name} in the image {shown} is {member.size} bytes, over the {cap}-byte cap", "too_large")
    source = layer.extractfile(member)
    assert source is not None  # a regular file's member always has data
    with source, open(dest, "xb") as out:
        writer = HashedWriter(out)
        while chunk := source.read(CHUNK_BYTES):
            writer.write(chunk)
        return writer.done()
