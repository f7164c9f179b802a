#!/usr/bin/env bash
# suite: fp8 weights: the fp8 kernel tests, then bench_fp8_weights (kernels per shape, bf16 / fp8 engines)
# One device call for FP8 weights, under 8 minutes on an H200: install infhip into the
# GPU machine's Python (offline), the fp8 kernel tests compiled on the GPU, then the benchmark
# (kernels per shape, then bf16 / fp8 / fp8 + LM head engines side by side). Logs and JSON under $OUT.
#   bash benchmarks/gpu/run.sh fp8            (on the H200, repo root)
set -o pipefail
OUT=${OUT:-/tmp/infhip-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout 150 python3 -m pytest -q -x tests/test_fp8_skinny_gemm.py 2>&1 | tail -15 | tee "$OUT/gpu_fp8_tests.log"
# what is left of 8 minutes, less a margin for the table and the copy back
LEFT=$(( 455 - $(date +%s) + T0 ))
python3 -m benchmarks.speed.bench_fp8_weights --out "$OUT" --deadline-s "$LEFT" "$@" 2>&1 \
  | grep -v -E "Warning|warn_once" | tee "$OUT/bench_fp8_weights.log" | tail -60
