#!/usr/bin/env bash
# Copy the CRDs (source of truth: deploy/crds/) into the Helm chart's crds/ directory.
# Run after editing deploy/crds/; tests/kube/test_chart.py fails while the copies differ.
set -euo pipefail
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
src="$repo_root/deploy/crds"
dst="$repo_root/deploy/helm/lorafleet/crds"
mkdir -p "$dst"
# Remove chart copies whose source is gone, then copy every source CRD.
for f in "$dst"/*.yaml; do
    [ -e "$f" ] || continue
    [ -e "$src/$(basename "$f")" ] || rm -v "$f"
done
cp -v "$src"/*.yaml "$dst"/
