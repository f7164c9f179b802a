#!/usr/bin/env bash
# suite: the first call of a GPU session (~3 min): every preset's tiny engine built for the GPU, generating under jit=forbid (carry .whl/serve)
# The GPU smoke call (benchmarks/gpu/smoke.py; docs/gpu_runbook.md's call 1): the serving wheels
# (.whl/serve, from benchmarks/gpu/stage/serving_wheels.sh) into /tmp/site, infhip installed
# offline, then every configuration's tiny random engine built for this GPU and generating in a
# fresh process under jit="forbid" with an unwritable Triton cache. Table in $OUT/smoke.log, raw
# rows in $OUT/gpu_smoke.json. Arguments go to smoke.py (--only dense,3k-flash-fp8, ...).
#   bash benchmarks/gpu/run.sh smoke            (on the GPU machine, repo root)
OUT=${OUT:-/tmp/infhip-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# the serving wheels: carried (.whl/serve), or already in /tmp/site from an earlier call on this warm
# machine (a call that carries a Qwen part instead has no room for them)
if ls .whl/serve/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/serve/*.whl
fi
[ -d /tmp/site/fastapi ] || { echo "no serving wheels: carry .whl/serve (benchmarks/gpu/stage/serving_wheels.sh)"; exit 2; }
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
python3 -c "import torch,triton;print(torch.__version__,triton.__version__)"
timeout 420 python3 -m benchmarks.gpu.smoke --out $OUT "$@" 2>&1 | grep -v -E "Writing model|Warning" | tee $OUT/smoke.log
