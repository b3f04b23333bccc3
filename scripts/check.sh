#!/usr/bin/env bash
# Machine checks over the product and development code: format and lint (ruff, with complexity
# limits), types (mypy) and the import layers (import-linter, contracts in pyproject.toml). scripts/test.sh runs this first.
#   bash scripts/check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/bootstrap.sh
echo "check: ruff format" >&2
ruff format --check .
echo "check: ruff" >&2
ruff check .
echo "check: mypy" >&2
# One cache for every checkout on the machine (mypy checks each cached file's hash, so another
# checkout's entries are reused only for identical sources): a fresh clone, as CI's, then
# checks in seconds instead of half a minute or more.
MYPY_CACHE_DIR=${MYPY_CACHE_DIR:-${LORAFLEET_CACHE:-$HOME/.cache/lorafleet}/mypy} mypy
echo "check: import-linter" >&2
# Through the checkout's interpreter, which sees the editable install's package mapping.
python -c 'import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())'
