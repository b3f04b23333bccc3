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
# Stock vLLM's CPU build in an environment of its own, for tests/vllm/ (the agent over vLLM
# servers). Cached by version: several minutes and about 6 GB cold.
bash scripts/build-vllm.sh
# Real storage servers for s3:// and oci:// sources (versitygw, distribution's registry, oras).
bash scripts/build-storage.sh
# SeaweedFS, an S3 store with an STS, for s3:// signed with a pod's web identity. Cached by
# version: about ten minutes and 4 GB of Go caches cold.
bash scripts/build-seaweedfs.sh
# The Gateway API Inference Extension's endpoint picker (v1.5.0's EPP) for tests/gateway/.
bash scripts/build-epp.sh
# Lint, types and import layers first: a failure there fails the suite.
bash scripts/check.sh
# Two worker processes, each taking whole files (a module's agents and engines stay in one
# process, and each worker starts its own control plane): most of the suite waits on real
# processes, so two workers halve it even on 2 cores. LORAFLEET_TEST_WORKERS=0 (or -n 0 among the
# arguments) runs everything in this one process.
exec python -m pytest -n "${LORAFLEET_TEST_WORKERS:-2}" --dist loadfile "$@"
