#!/usr/bin/env bash
# suite: the ahead-of-time engine: AOT GPU tests, then bench_cold_start
# One device call for the ahead-of-time engine: install infhip into the GPU machine's
# Python (offline), the AOT GPU tests, then the cold-start benchmark. Logs and JSON under $OUT.
#   bash benchmarks/gpu/run.sh aot            (on the H200, repo root)
set -o pipefail
OUT=${OUT:-/tmp/infhip-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -x tests/test_gpu_aot.py 2>&1 | tail -15 | tee "$OUT/gpu_aot_tests.log"
python3 -m benchmarks.speed.bench_cold_start --out "$OUT" "$@" 2>&1 | grep -v -E "Warning|warn_once" | tail -40 | tee "$OUT/bench_cold_start.log"
