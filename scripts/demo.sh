#!/usr/bin/env bash
# The main job on the embedded local default (installs what it needs, idempotently): a real
# control plane, two node agents (tp=2, dp=2 on the CPU, a tiny generated model), the operator;
# applies deploy/examples/, waits for Ready, runs Generate with an adapter, prints
# `kubectl get la`, and stops everything on exit (Ctrl-C too). --keep-running leaves it up.
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/bootstrap.sh
# kube-apiserver, etcd, kubectl (and helm) built from Go modules; cached after the first run.
bash scripts/build-kube.sh
# The demo (development tooling, devtools/) reads the examples and CRDs from this checkout.
exec python -m lorafleet_dev.demo --repo "$PWD" "$@"
