"""The repository layout must not shadow the standard library's `operator` (docs/design.md §1)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_stdlib_operator_importable_from_repo_root():
    result = subprocess.run(
        [sys.executable, "-c", "import operator; print(operator.add(2, 3))"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "5"
    assert not (ROOT / "operator" / "__init__.py").exists()
