#!/usr/bin/env bash
# suite: re-measure the README's headline rows, each beside its same-run baseline (~9.5 min; needs_h200)
# One device call (under 9.5 minutes on an H200): re-measure the README's headline figures after a
# refactor, each against its baseline in the same run, most important first; a step
# that would pass the deadline is skipped and named. Logs and JSON under $OUT.
#   bash benchmarks/gpu/run.sh headline            (on the H200, repo root)
set -o pipefail
OUT=${OUT:-/tmp/infhip-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s); DEADLINE=${DEADLINE_S:-545}
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3

# step NAME CAP_S COMMAND...: run COMMAND for at most CAP_S seconds and what is left of the deadline
step() {
  local name=$1 cap=$2; shift 2
  local left=$(( DEADLINE - $(date +%s) + T0 ))
  if (( left < 30 )); then echo "SKIPPED $name (deadline)" | tee -a "$OUT/skipped.txt"; return; fi
  (( cap > left )) && cap=$left
  echo "=== $name (cap ${cap}s)"
  timeout -s INT "$cap" "$@" 2>&1 | grep -v -E "Warning|warn_once|converting" | tee "$OUT/$name.log" | tail -14
}

step e2e_decode_512k 170 python3 -m benchmarks.speed.bench_decode_e2e --out "$OUT/e2e" --contexts 512000 \
  --configs dense,3k-flash --kv-gib 72
step token_drop_128k 130 python3 -m benchmarks.speed.bench_token_drop --out "$OUT/token_drop" --models llama-3.1-8b \
  --lengths 128k --retention 0.3 --spare-anchors 1 --drop-layers every \
  --knobs drop_point=before_attention,reenter=true  # the figure's schedule (every full layer, re-entry)
step fp8_engines 175 python3 -m benchmarks.speed.bench_fp8_weights --out "$OUT/fp8" --engines bf16,fp8 \
  --kernel-budget-s 0 --deadline-s 250
step layer_decode_1m 80 python3 -m benchmarks.speed.bench_infinitehip --out "$OUT/layer_decode" --presets 3k-flash \
  --no-prefill --contexts 1m
step constants 80 python3 -m benchmarks.speed.bench_constants --out "$OUT/constants"
step layer_prefill_1m 80 python3 -m benchmarks.speed.bench_infinitehip --out "$OUT/layer_prefill" --presets 3k \
  --no-decode --prefill-configs preset --contexts 1m
echo "total $(( $(date +%s) - T0 )) s"
