#!/usr/bin/env bash
# suite: sampling features and structured output: sampler tests, bench_sampling, bench_structured_decode (carry .whl/xg)
# The sampling features' speed row in one device call (~5 min): the sampler kernels' tests on the GPU, then
# decode with logprobs=5 / penalties (bench_sampling.py) and under a JSON schema
# (bench_structured_decode.py), each against plain decode in the same run, batch 1 and 16.
# ENGINE (default: a random-weight Qwen2.5-Coder-0.5B bf16 engine built here, which holds the
# sampler's kernels; the benchmarks are greedy with ignore_eos, so weights change no step's work,
# and bench_structured_decode.py's schema never closes on random weights). xgrammar and its needs
# are not on the GPU image: carry .whl/xg, filled here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl/xg \
#     xgrammar==0.2.9 apache-tvm-ffi pydantic pydantic-core typing-inspection annotated-types
#   bash benchmarks/gpu/run.sh sampling [ENGINE]
set -o pipefail
OUT=${OUT:-/tmp/infhip-out}; mkdir -p "$OUT"
ENGINE=${1:-/tmp/q05-random}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-xg .whl/xg/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site-xg || exit 1  # appended: the image's own packages win
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_sampling_kernels.py tests/test_sampling_features.py 2>&1 \
  | tail -3 | tee $OUT/sampling_tests.log
if [ ! -d "$ENGINE" ]; then
  timeout 150 python3 -m infhip.builder.cli --model qwen2.5-coder-0.5b --random-weights --device cuda --output "$ENGINE" \
    --max-seq-len 4096 --max-batch-size 16 --quiet --force 2>&1 | tail -2
fi
INFHIP_JIT=forbid timeout 170 python3 -m benchmarks.speed.bench_sampling --engine $ENGINE --batch-sizes 1,16 --out $OUT/sampling.json 2>&1 \
  | grep -v -E "Warning|warn_once" | tee $OUT/sampling.log | tail -n 12
INFHIP_JIT=forbid timeout 170 python3 -m benchmarks.speed.bench_structured_decode --engine $ENGINE --batch 1 16 --out $OUT/structured_decode.json 2>&1 \
  | grep -v -E "Warning|warn_once" | tee $OUT/structured_decode.log | tail -n 12
