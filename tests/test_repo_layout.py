"""The repository layout must not shadow the standard library's `operator` (docs/design.md §1)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_stdlib_operator_importable_from_repo_root():
    result = subprocess.run(
        [sys.executable, "-c", "import operator; print(operator.add(2, 3))"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "5"
    assert not (ROOT / "operator" / "__init__.py").exists()


def test_every_product_package_is_installed():
    """A package missing from pyproject.toml's explicit list works in the editable checkout (the
    directory is on the path) but is left out of the wheel, so the images would lack it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    roots = {name: ROOT / path for name, path in config["package-dir"].items() if name}
    roots["node_agent"] = ROOT / "node_agent"
    found = set()
    for name, root in roots.items():
        for init in root.rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                found.add(".".join((name, *init.parent.relative_to(root).parts)))
    assert found - listed == set(), "packages missing from [tool.setuptools] packages"
    assert listed - found == set(), "listed packages that do not exist"
