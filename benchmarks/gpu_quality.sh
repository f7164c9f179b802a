#!/usr/bin/env bash
# Real-model quality on the H200 (issues 3 and 5): SmolLM2-135M bf16, staged from this machine
# (python -m infhip.eval.stage split engines/smol-3k-bf16; one part per device call, the KJV
# package copied to .stage/pylib), then joined here. The same weights run with the dense plan
# (a copy of the engine whose config.json holds Plan.dense; weights hard-linked) and the 3k plan.
#   bash benchmarks/gpu_quality.sh            (on the H200, repo root, after all parts arrived)
set -eo pipefail
OUT=${OUT:-/tmp/infhip-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/.stage/pylib:$PYTHONPATH
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
S=engines/smol-3k-bf16; D=engines/smol-dense-bf16
[ -d $S ] || python3 -m infhip.eval.stage join .stage/smol-3k-bf16 $S
if [ ! -d $D ]; then
  mkdir -p $D && cp -rl $S/. $D/ && rm $D/config.json
  python3 - <<'PY'
import dataclasses
from infhip.config import EngineConfig
c = EngineConfig.load("engines/smol-3k-bf16")
dense = dataclasses.replace(c.plan, preset="dense", infinitehip=None,
                            layers=tuple(dataclasses.replace(l, plugin="dense") for l in c.plan.layers))
dataclasses.replace(c, plan=dense).save("engines/smol-dense-bf16")
PY
fi
E="--engine $D --engine $S --device cuda --kv-cache-gib 16"
infhip-eval passkey $E --lengths 4k,8k,16k,32k --depths 0.1,0.5,0.9 --samples 5 \
    --json $OUT/passkey_smol_gpu.json --markdown $OUT/passkey_smol_gpu.md --plot $OUT/passkey_smol_gpu.png
infhip-eval recall --engine $S --device cuda --kv-cache-gib 16 --lengths 8k,16k,32k --chunk 64 \
    --json $OUT/recall_smol_gpu.json --markdown $OUT/recall_smol_gpu.md --plot $OUT/recall_smol_gpu.png
infhip-eval ppl $E --lengths 16k,32k --chunk 256 --samples 2 --json $OUT/ppl_smol_gpu.json --markdown $OUT/ppl_smol_gpu.md
infhip-eval niah $E --lengths 16k,32k --variants single,multikey --depths 0.5 --samples 3 \
    --json $OUT/niah_smol_gpu.json --markdown $OUT/niah_smol_gpu.md
