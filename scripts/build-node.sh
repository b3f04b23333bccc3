#!/usr/bin/env bash
# Build a real Kubernetes node for tests from Go modules, beside scripts/build-kube.sh's control
# plane: kubelet, kube-scheduler and kube-proxy (k8s.io/kubernetes, the same version as the
# control plane), containerd 2.x with ctr and its runc shim (github.com/containerd/containerd/v2)
# and a pause program for the sandbox image. runc and the CNI plugins come from Debian's packages
# (runc, containernetworking-plugins), installed with apt-get when missing. Beside them the
# cluster's DNS server: CoreDNS (github.com/coredns/coredns) with only the plugins the node's
# DNS uses (bind, ready, errors, kubernetes, forward), in a cache of its own.
#
# The binaries land in caches keyed by the versions and are reused when present:
#   ${LORAFLEET_CACHE:-$HOME/.cache/lorafleet}/node-<k8s>-containerd-<containerd>/bin/
#   ${LORAFLEET_CACHE:-$HOME/.cache/lorafleet}/coredns-<coredns>/bin/coredns
# A cold build takes about 4 minutes on 2 cores after build-kube.sh (Go's build cache is shared)
# and CoreDNS a few more; a second run returns in well under a second.
#
# Usage:
#   scripts/build-node.sh                  build if needed, print progress on stderr
#   scripts/build-node.sh --print-bin-dir  build if needed, then print only the node's bin dir
#   scripts/build-node.sh --print-coredns-bin-dir
#                                          build if needed, then print only CoreDNS's bin dir
#   either with --no-build                 print the dir if both are built, else fail (exit 1)
#
# Versions: LORAFLEET_K8S_VERSION (shared with build-kube.sh), LORAFLEET_CONTAINERD_VERSION,
# LORAFLEET_COREDNS_VERSION.
set -euo pipefail

k8s_version=${LORAFLEET_K8S_VERSION:-v1.35.4}
# containerd 2.2 is the release line supported with Kubernetes 1.34-1.35.
containerd_version=${LORAFLEET_CONTAINERD_VERSION:-v2.2.9}
# This CoreDNS release's go.mod needs Go 1.26 (the `go` check below asks for it).
coredns_version=${LORAFLEET_COREDNS_VERSION:-v1.15.0}
cache_root=${LORAFLEET_CACHE:-$HOME/.cache/lorafleet}
node_prefix="$cache_root/node-$k8s_version-containerd-$containerd_version"
coredns_prefix="$cache_root/coredns-$coredns_version"

print_dir=""
no_build=0
for arg in "$@"; do
    case "$arg" in
        --print-bin-dir) print_dir="$node_prefix/bin" ;;
        --print-coredns-bin-dir) print_dir="$coredns_prefix/bin" ;;
        --no-build) no_build=1 ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        *) echo "build-node: unknown argument: $arg" >&2; exit 2 ;;
    esac
done

log() { echo "build-node: $*" >&2; }

finish() {
    if [ -n "$print_dir" ]; then
        echo "$print_dir"
    else
        log "binaries in $node_prefix/bin and $coredns_prefix/bin"
    fi
}

# Debian packages the node needs at run time (not cached by us: apt-get is idempotent).
# runc: the OCI runtime; CNI plugins: bridge, host-local, loopback, portmap; iptables: kube-proxy
# and the portmap plugin; mmdebstrap: the images' base root filesystem. Beside them, for the
# suite rather than the node: a C compiler, with which the engine builds its compiled CPU kernels
# at first use (node_agent/engine/kernels/cpu_kernels.py), so that tests run them, not skip them.
ensure_packages() {
    local missing=()
    command -v cc >/dev/null || command -v gcc >/dev/null || missing+=(gcc)
    [ -x /usr/sbin/runc ] || [ -x /usr/bin/runc ] || missing+=(runc)
    [ -x /usr/lib/cni/bridge ] || missing+=(containernetworking-plugins)
    command -v iptables >/dev/null || missing+=(iptables)
    command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
    command -v buildah >/dev/null || missing+=(buildah)
    [ "${#missing[@]}" = 0 ] && return 0
    if [ "$no_build" = 1 ]; then
        log "missing Debian packages: ${missing[*]} (run scripts/build-node.sh)"
        exit 1
    fi
    [ "$(id -u)" = 0 ] || { log "missing Debian packages ${missing[*]}; installing them needs root"; exit 1; }
    log "installing Debian packages: ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2 \
        || { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2; }
}

ensure_packages
if [ -f "$node_prefix/.complete" ] && [ -f "$coredns_prefix/.complete" ]; then
    finish
    exit 0
fi
if [ "$no_build" = 1 ]; then
    for p in "$node_prefix" "$coredns_prefix"; do
        [ -f "$p/.complete" ] || log "not built yet: $p/bin (run scripts/build-node.sh; minutes cold)"
    done
    exit 1
fi

command -v go >/dev/null || { log "the go command is required (Go >= 1.26)"; exit 1; }
export GOFLAGS="-mod=mod -buildvcs=false"
export GOTOOLCHAIN=${GOTOOLCHAIN:-auto}
export CGO_ENABLED=0

module_field() { # <module@version> <field>
    go mod download -json "$1" | python3 -c 'import json,sys; print(json.load(sys.stdin)[sys.argv[1]])' "$2"
}

build_kubernetes_node() {
    # The same wrapper-module technique as build-kube.sh (see docs/kube-test-harness.md): the
    # staging modules replaced by their published v0.Y.Z, read from kubernetes' own go.mod.
    local ver=$k8s_version minor_ver="v0.${k8s_version#v1.}" wrapper="$src/kubernetes"
    local upstream_mod go_line godebug_line staging
    upstream_mod=$(module_field "k8s.io/kubernetes@$ver" GoMod)
    go_line=$(grep -m1 -E '^go [0-9]' "$upstream_mod")
    godebug_line=$(grep -E '^godebug ' "$upstream_mod" || true)
    staging=$(sed -nE 's#^[[:space:]]*(replace[[:space:]]+)?(k8s\.io/[^[:space:]]+)[[:space:]]+=>[[:space:]]+\./staging/.*#\2#p' "$upstream_mod")
    [ -n "$staging" ] || { log "no staging replaces found in $upstream_mod"; exit 1; }
    rm -rf "$wrapper"
    mkdir -p "$wrapper"
    {
        echo "// Generated by scripts/build-node.sh: builds k8s.io/kubernetes $ver node commands."
        echo "module lorafleet.local/nodebuild"
        echo
        echo "$go_line"
        [ -n "$godebug_line" ] && echo "$godebug_line"
        echo
        echo "require k8s.io/kubernetes $ver"
        echo
        echo "replace ("
        for m in $staging; do echo "	$m => $m $minor_ver"; done
        echo ")"
        echo
        echo "tool ("
        echo "	k8s.io/kubernetes/cmd/kubelet"
        echo "	k8s.io/kubernetes/cmd/kube-scheduler"
        echo "	k8s.io/kubernetes/cmd/kube-proxy"
        echo ")"
    } > "$wrapper/go.mod"
    log "kubernetes $ver: resolving modules"
    (cd "$wrapper" && go mod tidy)
    local major=${ver#v}; major=${major%%.*}
    local minor=${ver#v*.}; minor=${minor%%.*}
    local date; date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
    local ldflags="-s -w" pkg
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ldflags+=" -X $pkg.gitVersion=$ver -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
        ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$date"
    done
    log "kubernetes $ver: compiling kubelet, kube-scheduler, kube-proxy"
    (cd "$wrapper" && go build -trimpath -ldflags "$ldflags" -o "$stage/" \
        k8s.io/kubernetes/cmd/kubelet \
        k8s.io/kubernetes/cmd/kube-scheduler \
        k8s.io/kubernetes/cmd/kube-proxy)
}

build_containerd() {
    # containerd's go.mod has no local replaces, so `go install cmd@version` works. Without cgo:
    # the btrfs snapshotter (cgo) is left out by its build tag; overlayfs and native remain.
    local ver=$containerd_version pkg=github.com/containerd/containerd/v2
    local ldflags="-s -w -X $pkg/version.Version=$ver -X $pkg/version.Package=$pkg"
    log "containerd $ver: compiling containerd, ctr, containerd-shim-runc-v2"
    GOFLAGS=-buildvcs=false GOBIN="$stage" go install -trimpath -tags "no_btrfs" -ldflags "$ldflags" \
        "$pkg/cmd/containerd@$ver" "$pkg/cmd/ctr@$ver" "$pkg/cmd/containerd-shim-runc-v2@$ver"
}

build_pause() {
    # The pod sandbox's process: sleeps until SIGINT/SIGTERM, reaps adopted children (it is PID
    # 1 of the pod's PID namespace when that is shared). Static, no cgo, no libc.
    local wrapper="$src/pause"
    rm -rf "$wrapper"
    mkdir -p "$wrapper"
    cat > "$wrapper/go.mod" <<'EOF'
module lorafleet.local/pause

go 1.22
EOF
    cat > "$wrapper/main.go" <<'EOF'
// Command pause is the pod sandbox process of the lorafleet test node.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 4)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range signals {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
EOF
    log "pause: compiling"
    (cd "$wrapper" && go build -trimpath -ldflags "-s -w" -o "$stage/pause" .)
}

build_coredns() {
    # A main package of our own instead of CoreDNS's: its core/plugin imports every plugin (the
    # cloud DNS ones bring the AWS, Azure and Google SDKs); ours imports five and names them, in
    # the order of CoreDNS's plugin.cfg, as the only directives a Corefile may use.
    local ver=$coredns_version wrapper="$src/coredns" go_line
    go_line=$(grep -m1 -E '^go [0-9]' "$(module_field "github.com/coredns/coredns@$ver" GoMod)")
    rm -rf "$wrapper"
    mkdir -p "$wrapper"
    {
        echo "// Generated by scripts/build-node.sh: CoreDNS $ver with the test node's plugins."
        echo "module lorafleet.local/corednsbuild"
        echo
        echo "$go_line"
        echo
        echo "require github.com/coredns/coredns $ver"
    } > "$wrapper/go.mod"
    cat > "$wrapper/main.go" <<'GO'
// Command coredns is CoreDNS with the plugins the lorafleet test node's cluster DNS uses.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"
)

func init() {
	dnsserver.Directives = []string{"bind", "ready", "errors", "kubernetes", "forward"}
}

func main() {
	coremain.Run()
}
GO
    log "coredns $ver: resolving modules"
    (cd "$wrapper" && go mod tidy)
    log "coredns $ver: compiling"
    (cd "$wrapper" && go build -trimpath -ldflags "-s -w -X github.com/coredns/coredns/coremain.GitCommit=$ver" \
        -o "$stage/coredns" .)
    "$stage/coredns" -version >&2
}

build_node() {
    build_pause
    build_containerd
    build_kubernetes_node
    local b
    for b in kubelet kube-scheduler kube-proxy containerd ctr containerd-shim-runc-v2 pause; do
        [ -x "$stage/$b" ] || { log "missing $b after build"; exit 1; }
    done
    "$stage/kubelet" --version >&2
    "$stage/containerd" --version >&2
}

# build_once PREFIX FUNCTION: unless PREFIX/.complete exists, run FUNCTION (it writes into
# $stage and may use $src) and move what it wrote to PREFIX/bin. A concurrent second build
# waits for the first on PREFIX/.lock and then finds the marker.
build_once() {
    local prefix=$1 build=$2 start
    [ -f "$prefix/.complete" ] && return 0
    mkdir -p "$prefix"
    exec 9>"$prefix/.lock"
    if ! flock -n 9; then
        log "another build holds $prefix/.lock; waiting for it"
        flock 9
    fi
    if [ ! -f "$prefix/.complete" ]; then
        log "building into $prefix"
        start=$(date +%s)
        src="$prefix/src"
        stage="$prefix/stage"
        rm -rf "$stage"
        mkdir -p "$src" "$stage"
        "$build"
        rm -rf "$prefix/bin"
        mv "$stage" "$prefix/bin"
        touch "$prefix/.complete"
        log "$prefix: done in $(( $(date +%s) - start ))s"
    fi
    exec 9>&-
}

build_once "$node_prefix" build_node
build_once "$coredns_prefix" build_coredns
finish
