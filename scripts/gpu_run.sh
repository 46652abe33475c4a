#!/usr/bin/env bash
# One lease on a lent GPU machine (the device tool): bitsandbytes from the carried wheel, then gpu_check.py and
# bench_cuda.py, their JSON and logs into $OUT. Usage there: bash scripts/gpu_run.sh [bench_cuda args...]
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton, transformers, bitsandbytes as b; print(torch.__version__, triton.__version__, transformers.__version__, b.__version__)"
for f in hf_efficient/optim/*_cpu.c; do  # the CPU reference's C kernels, built in parallel
  python3 -c "from hf_efficient.optim import _native; _native.load('$(basename "$f")')" >/dev/null 2>&1 &
done; wait
SECONDS=0  # the benchmark first: what a lease is mostly for
timeout "${BENCH_S:-240}" python3 scripts/bench_cuda.py --out "$OUT" "$@" > "$OUT/bench.log" 2>&1
echo "bench rc=$? in ${SECONDS}s"; grep -vE "^\{" "$OUT/bench.log" | grep -v Warning | tail -60 | cut -c1-300
SECONDS=0
timeout "${GPU_CHECK_S:-150}" python3 scripts/gpu_check.py --out "$OUT" > "$OUT/gpu_check.log" 2>&1
echo "gpu_check rc=$? in ${SECONDS}s"; grep -E "'ok': False|gpu_check:|Error" "$OUT/gpu_check.log" | cut -c1-300 | tail -40
