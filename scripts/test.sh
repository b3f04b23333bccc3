#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs (idempotently), then runs pytest.
#   bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/bootstrap.sh
# The real control plane (kube-apiserver, etcd, kubectl, helm) built from Go modules; cached.
bash scripts/build-kube.sh
# The real node beside it (kubelet, kube-scheduler, kube-proxy, containerd; runc and CNI plugins
# from Debian; CoreDNS for cluster DNS): tests/kube/test_real_node.py. Cached by version.
bash scripts/build-node.sh
# Lint, types and import layers first: a failure there fails the suite.
bash scripts/check.sh
exec python -m pytest "$@"
