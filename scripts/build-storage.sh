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
bin_dir="$prefix/bin"

mode=build
print=0
for arg in "$@"; do
    case "$arg" in
        --print-bin-dir) print=1 ;;
        --no-build) mode=check ;;
        -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
        *) echo "build-storage: unknown argument: $arg" >&2; exit 2 ;;
    esac
done

log() { echo "build-storage: $*" >&2; }

# Done when the marker is there: print what was asked for and leave.
exit_if_built() {
    [ -f "$prefix/.complete" ] || return 0
    if [ "$print" = 1 ]; then echo "$bin_dir"; else log "binaries in $bin_dir"; fi
    exit 0
}

exit_if_built
[ "$mode" = build ] || { log "not built yet: $bin_dir (run scripts/build-storage.sh; minutes cold)"; exit 1; }
mkdir -p "$prefix"
# A developer and a test session may build at once: the second waits on the lock, then finds
# the marker instead of compiling everything again.
exec 9>"$prefix/.lock"
flock -n 9 || { log "another build holds $prefix/.lock; waiting for it"; flock 9; }
exit_if_built

command -v go >/dev/null || { log "the go command is required (Go >= 1.26)"; exit 1; }
# None of the three modules has local replace directives, so `go install cmd@version` builds each
# with exactly the dependency versions its own go.mod pins.
export GOFLAGS=-buildvcs=false
export GOTOOLCHAIN=${GOTOOLCHAIN:-auto}
export CGO_ENABLED=0
stage="$prefix/stage"
rm -rf "$stage"
mkdir -p "$stage"
start=$(date +%s)

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

# Publish atomically: the bin dir either holds all three binaries or does not exist.
rm -rf "$bin_dir"
mv "$stage" "$bin_dir"
touch "$prefix/.complete"
log "done in $(( $(date +%s) - start ))s"
exit_if_built
