#!/usr/bin/env bash
# Machine checks over the product and development code: lint (ruff), types (mypy) and the
# import layers (import-linter, contracts in pyproject.toml). scripts/test.sh runs this first.
#   bash scripts/check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/bootstrap.sh
echo "check: ruff" >&2
ruff check .
echo "check: mypy" >&2
mypy
echo "check: import-linter" >&2
lint-imports
