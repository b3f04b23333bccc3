"""Mount points the node and the image builder leave under their work dirs, and their removal
(containerd's overlay snapshots and network namespaces, the kubelet's volumes, buildah's
overlay storage): nothing they mounted may outlive them."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (\\040 ...)."""
    return field.encode().decode("unicode_escape")


def mounts_under(root: Path) -> list[Path]:
    """Mount points at or below ``root``, deepest first (the order to unmount them)."""
    top = str(root).rstrip("/")
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = _unescape(line.split()[4])  # field 5: the mount point
        if point == top or point.startswith(top + "/"):
            found.append(Path(point))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def unmount_all(root: Path) -> None:
    """Lazily unmount everything at or below ``root``; log what would not go."""
    for point in mounts_under(root):
        proc = subprocess.run(["umount", "--lazy", str(point)], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            log.warning("could not unmount %s: %s", point, proc.stderr.strip())
