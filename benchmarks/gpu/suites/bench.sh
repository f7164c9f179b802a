#!/usr/bin/env bash
# suite: the GPU-marked tests, then the benchmarks named (dense | infinitehip | token_drop; default dense infinitehip)
# One device call: install infhip into the GPU machine's Python (offline), run the GPU-marked
# tests, then the benchmarks named as arguments (default: dense infinitehip). Logs under $OUT.
#   bash benchmarks/gpu/run.sh bench [dense] [infinitehip] [token_drop]     (on the H200, repo root)
set -o pipefail
OUT=${OUT:-/tmp/infhip-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -m pytest -q -m gpu tests 2>&1 | tail -5 | tee "$OUT/gpu_tests.log"
for bench in "${@:-dense infinitehip}"; do
  for b in $bench; do
    case $b in
      dense) module=benchmarks.speed.bench_dense_llama8b ;;
      infinitehip) module=benchmarks.speed.bench_infinitehip ;;
      token_drop) module=benchmarks.speed.bench_token_drop ;;
      *) echo "unknown benchmark $b (dense | infinitehip | token_drop)"; exit 2 ;;
    esac
    python3 -m "$module" --out "$OUT" 2>&1 | grep -v -E "converting|Warning|warn" | tee "$OUT/bench_$b.log"
  done
done
