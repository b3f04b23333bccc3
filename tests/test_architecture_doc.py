"""docs/architecture.md's module map matches the tree: every module listed, nothing stale."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("node_agent", "common/lorafleet_common", "operator/lorafleet_operator", "devtools/lorafleet_dev")
LISTED = re.compile(r"`((?:node_agent|common|operator|devtools)/[\w/]+\.py)`")


def modules_in_tree() -> set[str]:
    """Every module of the packages, `__init__.py` files aside (they hand names on)."""
    return {
        path.relative_to(ROOT).as_posix() for package in PACKAGES for path in (ROOT / package).rglob("*.py") if path.name != "__init__.py"
    }


def modules_in_doc() -> set[str]:
    return set(LISTED.findall((ROOT / "docs" / "architecture.md").read_text()))


def test_every_module_is_on_the_map() -> None:
    missing = modules_in_tree() - modules_in_doc()
    assert not missing, f"docs/architecture.md does not list: {sorted(missing)}"


def test_the_map_names_only_files_that_exist() -> None:
    stale = {path for path in modules_in_doc() if not (ROOT / path).is_file()}
    assert not stale, f"docs/architecture.md lists files that do not exist: {sorted(stale)}"
