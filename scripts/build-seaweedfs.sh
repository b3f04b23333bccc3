#!/usr/bin/env bash
# Build SeaweedFS's `weed` (Apache-2.0: github.com/seaweedfs/seaweedfs) from its Go module, with
# the ordinary `go` command: the S3 store with an STS (AssumeRoleWithWebIdentity against an OIDC
# issuer) that the web-identity tests run (devtools/lorafleet_dev/web_identity_servers.py).
# Nothing prebuilt is downloaded.
#
# Its go.mod has a replace directive, which `go install module/cmd@version` refuses: the module
# is downloaded through the Go module proxy (checked against the checksum database) and built
# as the main module, in the module cache, with exactly the versions its go.mod and go.sum pin.
#
# The binary lands in a cache keyed by the version and is reused when present:
#   ${LORAFLEET_CACHE:-$HOME/.cache/lorafleet}/seaweedfs-<version>/bin/weed
# A cold build takes about ten minutes on 2 cores (and about 2 GB of module and build cache);
# a second run returns in well under a second.
#
# Usage:
#   scripts/build-seaweedfs.sh                  build if needed, print progress on stderr
#   scripts/build-seaweedfs.sh --print-bin-dir  build if needed, then print only the bin dir
#   scripts/build-seaweedfs.sh --print-bin-dir --no-build
#                                               print the bin dir if built, else fail (exit 1) at once
#
# Version: LORAFLEET_SEAWEEDFS_VERSION (a version of github.com/seaweedfs/seaweedfs the Go module
# proxy serves; the project tags releases without a Go module version, so a pseudo-version).
set -euo pipefail

module=github.com/seaweedfs/seaweedfs
version=${LORAFLEET_SEAWEEDFS_VERSION:-v0.0.0-20261109003541-7506e5f91cd6}
prefix="${LORAFLEET_CACHE:-$HOME/.cache/lorafleet}/seaweedfs-$version"
name=build-seaweedfs cold="about ten minutes" help_lines=2,23p
. "$(dirname "$0")/go-build-cache.sh" "$@"

log "$module $version: downloading the module"
source_dir=$(go mod download -json "$module@$version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[ -n "$source_dir" ] && [ -f "$source_dir/go.mod" ] || { log "go mod download gave no module directory"; exit 1; }
log "$module $version: compiling weed (brings the AWS, Azure and GCP SDKs; the long part)"
(cd "$source_dir" && go build -trimpath -ldflags "-s -w" -o "$stage/weed" ./weed)

[ -x "$stage/weed" ] || { log "missing weed after build"; exit 1; }
"$stage/weed" version >&2

publish_build
