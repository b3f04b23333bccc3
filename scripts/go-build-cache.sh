# shellcheck shell=bash
# What the scripts that compile Go modules into a cache keyed by version share (build-storage.sh,
# build-seaweedfs.sh). Sourced with the script's arguments, after the script set:
#   name        its log prefix (build-storage)
#   prefix      the cache directory; binaries go to "$prefix/bin", a marker to "$prefix/.complete"
#   cold        how long a cold build takes, for the "not built yet" message
#   help_lines  the sed range of the script's header comment that -h prints (2,19p)
# It reads --print-bin-dir and --no-build, leaves at once when the build is there (printing only
# the bin dir with --print-bin-dir), fails (exit 1) with --no-build when it is not, and otherwise
# returns holding the build's lock, with an empty "$stage" to build into and the go settings
# exported; the script ends with `publish_build`.

bin_dir="$prefix/bin"
mode=build
print=0
for arg in "$@"; do
    case "$arg" in
        --print-bin-dir) print=1 ;;
        --no-build) mode=check ;;
        -h|--help) sed -n "$help_lines" "$0"; exit 0 ;;
        *) echo "$name: unknown argument: $arg" >&2; exit 2 ;;
    esac
done

log() { echo "$name: $*" >&2; }

# Done when the marker is there: print what was asked for and leave.
exit_if_built() {
    [ -f "$prefix/.complete" ] || return 0
    if [ "$print" = 1 ]; then echo "$bin_dir"; else log "built in $bin_dir"; fi
    exit 0
}

exit_if_built
[ "$mode" = build ] || { log "not built yet: $bin_dir (run scripts/$name.sh; $cold cold)"; exit 1; }
mkdir -p "$prefix"
# A developer and a test session may build at once: the second waits on the lock, then finds
# the marker instead of compiling everything again.
exec 9>"$prefix/.lock"
flock -n 9 || { log "another build holds $prefix/.lock; waiting for it"; flock 9; }
exit_if_built

command -v go >/dev/null || { log "the go command is required (Go >= 1.26)"; exit 1; }
export GOFLAGS=-buildvcs=false
export GOTOOLCHAIN=${GOTOOLCHAIN:-auto}
export CGO_ENABLED=0
stage="$prefix/stage"
rm -rf "$stage"
mkdir -p "$stage"
start=$(date +%s)

# Publish atomically: the bin dir either holds every binary or does not exist.
publish_build() {
    rm -rf "$bin_dir"
    mv "$stage" "$bin_dir"
    touch "$prefix/.complete"
    log "done in $(( $(date +%s) - start ))s"
    exit_if_built
}
