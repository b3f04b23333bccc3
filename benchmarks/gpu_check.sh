#!/usr/bin/env bash
# The one prepared GPU check (docs/kernels.md "GPU figures"), in one call of at most ten minutes:
#   1. the compiled triton cases of the kernel and paged-attention tests;
#   2. benchmarks/gpu_check.py: paged-decode and shrink/expand kernels against the device's
#      memory bandwidth, the engine's decode tokens/s on an 8B Llama shape (random bf16 weights)
#      with 8 adapters against none, greedy tokens against torch on the device (report.md);
#   3. the serving benchmark (benchmarks/bench_serving.py) on CUDA, bf16, tp=1.
# Every step is time-limited (570 s in all) and writes its log to OUT_DIR.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        (default: $OUT, else ./gpu-check)
#
# It runs with the machine's own python3 (PYTHON overrides) and the checkout on PYTHONPATH, so a
# bare GPU machine with torch, triton and safetensors needs nothing installed; transformers and
# peft are needed only for the side-by-side figure (1) of the serving benchmark, skipped without
# them. PEAK_GBPS overrides the device's peak memory bandwidth (default: from its name).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${1:-${OUT:-gpu-check}}
mkdir -p "$out"
py=${PYTHON:-python3}
peak=()
[ -n "${PEAK_GBPS:-}" ] && peak=(--peak-gbps "$PEAK_GBPS")
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
step tests 120 "$py" -m pytest -q -p no:cacheprovider tests/kernels tests/serving/test_paged_attention.py \
    --ignore=tests/kernels/test_gpu_check.py  # its own logic on the CPU; the check itself runs next
step check 300 "$py" benchmarks/gpu_check.py --out "$out/check" "${peak[@]}"
if "$py" -c 'import transformers, peft' 2>/dev/null; then
    step serving 150 "$py" benchmarks/bench_serving.py --device cuda --repeats 2 --open-loop-requests 32
else
    echo "transformers or peft missing: the serving benchmark runs without figure (1)" | tee -a "$out/summary.txt"
    step serving 150 "$py" benchmarks/bench_serving.py --device cuda --repeats 2 --open-loop-requests 32 \
        --only 2 --only 3 --only 4
fi
exit "$status"
