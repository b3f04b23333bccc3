"""The image builder's storages keep only the newest image of their target (lorafleet_dev.images).

Each agent image is gigabytes of layers, and every edit of the build context builds a new one:
after a build, the other images of the target leave its storage, with what only they used. On
a real buildah storage of the test's own, with two small images committed from scratch.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from lorafleet_dev.images import _buildah, _forget_other_images, _image_names
from lorafleet_dev.mounts import unmount_all

REPOSITORY = "localhost/lorafleet-probe"


def commit_empty(buildah: list[str], name: str) -> None:
    container = subprocess.run([*buildah, "from", "scratch"], capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([*buildah, "commit", "--rm", container, name], capture_output=True, check=True)


def test_a_build_leaves_only_the_newest_image_of_its_target(tmp_path: Path) -> None:
    storage = tmp_path / "buildah-probe"
    buildah = _buildah(storage)
    try:
        for tag in ("old", "new"):
            commit_empty(buildah, f"{REPOSITORY}:{tag}")
        commit_empty(buildah, "localhost/lorafleet-base:kept")
        assert sorted(_image_names(buildah, REPOSITORY)) == [f"{REPOSITORY}:new", f"{REPOSITORY}:old"]
        _forget_other_images(storage, REPOSITORY, keep=f"{REPOSITORY}:new")
        assert _image_names(buildah, REPOSITORY) == [f"{REPOSITORY}:new"]
        assert _image_names(buildah, "localhost/lorafleet-base") == ["localhost/lorafleet-base:kept"], "other repositories stay"
    finally:
        subprocess.run([*buildah, "rmi", "--all", "--force"], capture_output=True, check=False)
        unmount_all(storage)
