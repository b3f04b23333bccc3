#!/usr/bin/env bash
# The main job on the embedded local default (installs what it needs, idempotently):
# a tiny generated model on a tp=2, dp=2 CPU engine, two adapters, one mixed batch.
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/bootstrap.sh
exec python -m node_agent.demo "$@"
