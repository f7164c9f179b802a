#!/usr/bin/env bash
# One device call: install infhip into the GPU machine's Python (offline), run the GPU-marked
# tests, then the dense Llama-3.1-8B benchmark. Everything is logged under $OUT.
#   bash benchmarks/gpu_session.sh            (on the H200, from the repo root)
set -o pipefail
OUT=${OUT:-/tmp/infhip-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -m pytest -q -m gpu tests 2>&1 | tail -5 | tee "$OUT/gpu_tests.log"
python3 benchmarks/bench_dense_llama8b.py --out "$OUT" "$@" 2>&1 | grep -v -E "converting|Warning|warn" | tee "$OUT/bench.log"
