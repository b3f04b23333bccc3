#!/usr/bin/env bash
# Build real storage servers for the adapter-source tests from Go modules, with the ordinary `go`
# command: an S3-compatible gateway over a local directory (versitygw, Apache-2.0:
# github.com/versity/versitygw), an OCI registry (distribution's `registry`:
# github.com/distribution/distribution/v3) and the `oras` client that pushes artifacts to it
# (oras.land/oras). Nothing prebuilt is downloaded.
#
# The binaries land in a cache keyed by the three versions and are reused when present:
#   ${LORAFLEET_CACHE:-$HOME/.cache/lorafleet}/storage-versitygw-<v>-registry-<v>-oras-<v>/bin/
# A cold build takes several minutes on 2 cores; a second run returns in well under a second.
#
# Usage:
#   scripts/build-storage.sh                  build if needed, print progress on stderr
#   scripts/build-storage.sh --print-bin-dir  build if needed, then print only the bin dir
#   scripts/build-storage.sh --print-bin-dir --no-build
#                                             print the bin dir if built, else fail (exit 1) at once
#
# Versions: LORAFLEET_VERSITYGW_VERSION, LORAFLEET_REGISTRY_VERSION, LORAFLEET_ORAS_VERSION (each a
# version the Go module proxy serves).
set -euo pipefail

versitygw_version=${LORAFLEET_VERSITYGW_VERSION:-v1.8.0}
# distribution v3.1's go.mod needs Go 1.26; oras v1.3.6's needs 1.26.7.
registry_version=${LORAFLEET_REGISTRY_VERSION:-v3.1.2}
oras_version=${LORAFLEET_ORAS_VERSION:-v1.3.6}
prefix="${LORAFLEET_CACHE:-$HOME/.cache/lorafleet}/storage-versitygw-$versitygw_version-registry-$registry_version-oras-$oras_version"
name=build-storage cold="several minutes" help_lines=2,19p
. "$(dirname "$0")/go-build-cache.sh" "$@"
# None of the three modules has local replace directives, so `go install cmd@version` builds each
# with exactly the dependency versions its own go.mod pins.

build_versitygw() {
    local ver=$versitygw_version
    log "versitygw $ver: compiling (brings the AWS and Azure SDKs; the long part)"
    GOBIN="$stage" go install -trimpath \
        -ldflags "-s -w -X main.Version=$ver -X main.Build=$ver" \
        "github.com/versity/versitygw/cmd/versitygw@$ver"
}

build_registry() {
    local ver=$registry_version pkg=github.com/distribution/distribution/v3
    log "registry $ver: compiling"
    GOBIN="$stage" go install -trimpath \
        -ldflags "-s -w -X $pkg/version.version=$ver -X $pkg/version.mainpkg=$pkg" \
        "$pkg/cmd/registry@$ver"
}

build_oras() {
    local ver=$oras_version
    log "oras $ver: compiling"
    GOBIN="$stage" go install -trimpath -ldflags "-s -w" "oras.land/oras/cmd/oras@$ver"
}

log "building into $prefix (cold: several minutes on 2 cores)"
build_oras
build_registry
build_versitygw

for b in versitygw registry oras; do
    [ -x "$stage/$b" ] || { log "missing $b after build"; exit 1; }
done
"$stage/versitygw" --version >&2
"$stage/registry" --version >&2
"$stage/oras" version >&2

publish_build
