#!/usr/bin/env bash
# suite: the GPU test suite under jit=forbid with an unwritable Triton cache, then infhip-serve load on an 8B engine (TESTS_ONLY=1: tests only; carry .whl/serve)
# One device call: the GPU test suite under jit="forbid" with an empty, unwritable Triton cache,
# the server tests' files collected too, then the HTTP serving load on an 8B random-weight engine
# beside LLM.generate. Carry .whl/serve (benchmarks/gpu/stage/serving_wheels.sh: fastapi, uvicorn,
# pydantic, xgrammar, openai: not on the GPU image). Second call of a GPU session, after
# benchmarks/gpu/smoke.py (docs/gpu_runbook.md).
set -o pipefail
OUT=${OUT:-/tmp/infhip-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# the serving wheels: carried (.whl/serve), or already in /tmp/site from an earlier call on this warm
# machine (a call that carries a Qwen part instead has no room for them)
if ls .whl/serve/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/serve/*.whl
fi
[ -d /tmp/site/fastapi ] || { echo "no serving wheels: carry .whl/serve (benchmarks/gpu/stage/serving_wheels.sh)"; exit 2; }
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
INFHIP_JIT=forbid TRITON_CACHE_DIR=/proc/infhip-no-triton-cache timeout ${GPU_TESTS_S:-480} \
  python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/gpu_tests_strict.log"
# the suite alone takes ~400 s on one H100 (2026-12-05): TESTS_ONLY=1 stops here (one call each)
[ -n "${TESTS_ONLY:-}" ] && exit 0
python3 -m infhip.builder.cli --model llama-3.1-8b --random-weights --device cuda --output /tmp/l8b-serve \
  --max-seq-len 4096 --max-batch-size 64 --quiet --force 2>&1 | tail -2
python3 -m benchmarks.speed.bench_serving --engine /tmp/l8b-serve --device cuda --clients 32,128 --prompt-tokens 1024 \
  --max-tokens 128 --prompt-token-ids --out "$OUT/bench_serving.json" 2>&1 | tail -20 | tee "$OUT/bench_serving.log"
