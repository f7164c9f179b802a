#!/usr/bin/env bash
# suite: KV offloading: the offload tests on the GPU, then bench_offload [its arguments]
# One device call for KV offloading: install infhip (offline), run the offload tests on the GPU
# (pinned host pages, compiled kernels, CUDA graphs), then benchmarks/speed/bench_offload.py with the
# given arguments. Logs under $OUT.
#   bash benchmarks/gpu/run.sh offload [--contexts 512000] [--kv-dtype fp8]     (on the H200, repo root)
set -o pipefail
OUT=${OUT:-/tmp/infhip-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
free -g | head -2
python3 -m pytest -q tests/test_kv_offload.py tests/test_offload_pruning.py tests/test_offload_sparse_attention.py \
    tests/test_gpu_offload.py 2>&1 | tail -8 | tee "$OUT/offload_tests.log"
python3 -m benchmarks.speed.bench_offload --out "$OUT" "$@" 2>&1 | grep -v -E "converting|Warning|warn" | tee "$OUT/bench_offload.log"
