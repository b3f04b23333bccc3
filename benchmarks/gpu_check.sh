#!/usr/bin/env bash
# The one prepared GPU check (docs/serving.md "GPU figures"), in one call:
#   1. the compiled triton cases of the kernel and paged-attention tests;
#   2. paged-decode attention: triton vs torch, achieved GB/s vs the device's peak;
#   3. multi-LoRA shrink/expand: triton vs torch, achieved GB/s vs the peak;
#   4. the serving benchmark (benchmarks/bench_serving.py) on CUDA, bf16, tp=1.
# Every step is bounded (about 8 minutes in all on an H200) and writes its log to OUT_DIR.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        (default: $OUT, else ./gpu-check)
#
# It runs with the machine's own python3 (PYTHON overrides) and the checkout on PYTHONPATH, so a
# bare GPU machine with torch, triton and safetensors needs nothing installed; transformers and
# peft are needed only for the side-by-side figure (1) of the serving benchmark, skipped without
# them. PEAK_GBPS is the device's peak memory bandwidth (default 4800, an H200's).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${1:-${OUT:-gpu-check}}
mkdir -p "$out"
py=${PYTHON:-python3}
peak=${PEAK_GBPS:-4800}
export PYTHONPATH="$root:$root/common:$root/devtools${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
step() {  # step NAME SECONDS COMMAND...: run one step under a time limit, log it, keep going
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%H:%M:%S), limit ${limit}s)" | tee -a "$out/summary.txt"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc" | tee -a "$out/summary.txt"
    [ "$rc" -eq 0 ] || status=1
}
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; "$py" -c \
  'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'; } \
  2>&1 | tee "$out/device.txt"
step tests 150 "$py" -m pytest -q -p no:cacheprovider tests/kernels tests/serving/test_paged_attention.py
step paged_attention 90 "$py" benchmarks/bench_paged_attention_gpu.py --peak-gbps "$peak"
step shrink_expand 90 "$py" benchmarks/bench_kernels_gpu.py --peak-gbps "$peak" --ranks 16 64 --adapters 1 4 16
if "$py" -c 'import transformers, peft' 2>/dev/null; then
    step serving 180 "$py" benchmarks/bench_serving.py --device cuda --repeats 2 --open-loop-requests 32
else
    echo "transformers or peft missing: the serving benchmark runs without figure (1)" | tee -a "$out/summary.txt"
    step serving 180 "$py" benchmarks/bench_serving.py --device cuda --repeats 2 --open-loop-requests 32 \
        --only 2 --only 3 --only 4
fi
exit "$status"
