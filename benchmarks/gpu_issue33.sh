#!/usr/bin/env bash
# Issue 33's H200 row in one device call: decode with logprobs=5 / penalties (bench_sampling.py)
# and under a JSON schema (bench_structured_decode.py), each against plain decode in the same run,
# batch 1 and 16, on an engine already on the machine (default engines/q05-dense, the real
# Qwen2.5-Coder-0.5B bf16 engine benchmarks/gpu_issue32.sh builds). xgrammar and its needs are not
# on the GPU image: carry .whl/xg, filled here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl/xg \
#     xgrammar==0.2.9 apache-tvm-ffi pydantic pydantic-core typing-inspection annotated-types
#   bash benchmarks/gpu_issue33.sh [ENGINE]
set -o pipefail
OUT=${OUT:-/tmp/infhip-out}; mkdir -p "$OUT"
ENGINE=${1:-engines/q05-dense}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-xg .whl/xg/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site-xg || exit 1  # appended: the image's own packages win
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
timeout 200 python3 benchmarks/bench_sampling.py --engine $ENGINE --batch-sizes 1,16 --out $OUT/sampling.json 2>&1 \
  | grep -v -E "Warning|warn_once" | tee $OUT/sampling.log | tail -n 12
timeout 200 python3 benchmarks/bench_structured_decode.py --engine $ENGINE --batch 1 16 --out $OUT/structured_decode.json 2>&1 \
  | grep -v -E "Warning|warn_once" | tee $OUT/structured_decode.log | tail -n 12
