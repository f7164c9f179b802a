#!/usr/bin/env bash
# suite: token drop (UniPrefill) on Qwen2.5-Coder-0.5B: MODE = ruler-parity (default) | sweep | ttft (stage: stage/qwen.sh + hip-attn wheel)
# Token drop's GPU measurements on Qwen2.5-Coder-0.5B, each in one device call, side by side on the
# H200 (a 0.5B model leaves it mostly idle). ruler-parity: token-drop RULER (9 tasks x 5 prompts
# per length at 8K/16K/32K: dense, the authors' Llama schedule by depth, our earlier schedule) and
# InfiniteHiP mask parity with hip-attn 1.2.9 at 32K then 128K (as `window suspects` runs it,
# benchmarks/gpu/suites/window.sh). ttft: time to first token of dense and token-drop schedules on real
# prompts at the retention each reaches (benchmarks/speed/token_drop_ttft.py). Staged first, here:
#   bash benchmarks/gpu/stage/qwen.sh; pip download hip-attn==1.2.9 --no-deps -d .whl
# and carried by the calls as benchmarks/gpu/stage/qwen.sh says (the last call adds .whl/hip_attn-1.2.9-py3-none-any.whl).
# RULER runs one process per (column, length), so a step cut at the deadline loses only its own
# JSON. Everything comes back as $OUT/token-drop-qwen.tar.gz (at most 8 files come back) + the tables.
#   bash benchmarks/gpu/run.sh token-drop-qwen [ruler-parity|sweep|ttft] [DEADLINE_S=540]
# sweep: token-drop schedules beside dense, every column at once per length. 2026-12-05 it
# measured p 0.995 / 0.999, block_size 16, before_attention and the later layers 11:14:17:20 and
# 17:20 (docs/quality.md); now: the default (auto = 17, 20 on this model) again, half depth,
# the authors' Gemma rule by depth (14, 17, 20) and p = 0.98 with the default layers.
set -o pipefail
OUT=${OUT:-/tmp/infhip-out}; mkdir -p "$OUT"
MODE=${1:-ruler-parity}; DEADLINE=${2:-540}
W=/tmp/token-drop-qwen; mkdir -p $W engines
# The RULER JSONs (the prompts' text: 30 MB in all) stay behind: a file back is at most 16 MiB.
trap 'tar -czf $OUT/token-drop-qwen.tar.gz --exclude="ruler_*.json" -C $W .' EXIT
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
tar -xzf .stage/qwen-pylib.tar.gz -C .stage  # -> .stage/pylib-qwen: gguf, wonderwords, RULER data
export PYTHONPATH=$PWD/.stage/pylib-qwen:$PYTHONPATH INFHIP_CACHE=$PWD/.stage/cache
[ -f .stage/cache/qwen2.5-coder-0.5b-instruct.gguf ] || \
  python3 -m infhip.eval.stage join-file .stage/qwen05 .stage/cache/qwen2.5-coder-0.5b-instruct.gguf || exit 1
python3 -m zipfile -e .whl/hip_attn-1.2.9-py3-none-any.whl /tmp/hip-attn-1.2.9
[ -d engines/q05-dense ] || infhip-build --model qwen2.5-coder-0.5b --preset dense --dtype bfloat16 \
  --max-seq-len 33024 --device cuda --output engines/q05-dense --force --quiet || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $W/gpu.txt
python3 -c "import torch, triton, transformers as t; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', t.__version__)" >> $W/gpu.txt
echo "setup done at ${SECONDS}s"

left() { echo $((DEADLINE - SECONDS)); }
G="--device cuda --kv-cache-memory-bytes 8GiB"
ALL=niah_single_1,niah_single_2,niah_multikey_1,niah_multivalue,niah_multiquery,vt,cwe,fwe,qa_1
DROP="p=0.99,min_prompt_len=4096"  # min_prompt_len 4096: the default 8192 leaves "8K" prompts whole
AUTHORS="$DROP,drop_layers=5:8:11:14:17:20"  # the authors' Llama-3.1-8B list by depth, on this model
OLD="$DROP,drop_layers=every,drop_point=before_attention,reenter=true,spare_anchors=1"
ruler() {  # ruler NAME LENGTH [--token-drop SPEC]
  timeout $(left) infhip-eval ruler --engine engines/q05-dense $G "${@:3}" --template chat --tasks $ALL \
    --lengths $2 --samples 5 --json $W/ruler_$1_$2.json --markdown $W/ruler_$1_$2.md > $W/ruler_$1_$2.log 2>&1 \
    || echo "ruler $1 $2 exited $? at ${SECONDS}s" >> $W/cut.txt
}
parity() {  # parity LENGTH
  timeout $(left) python3 -m benchmarks.parity.infinitehip --hip-attn /tmp/hip-attn-1.2.9 --lengths $1 \
    --prompts niah_single_2:0,niah_single_2:1,passkey:0.5 --template chat --layers all --query-blocks 4 \
    --ref-per-head --out $W > $W/parity_$1.log 2>&1 || echo "parity $1 exited $? at ${SECONDS}s" >> $W/cut.txt
  echo "parity $1 done at ${SECONDS}s"
}
if [ "$MODE" = ttft ]; then  # 0.5B prefill is launch-bound on the H200: overhead, not speed-up
  timeout $(left) python3 -m benchmarks.speed.token_drop_ttft --engine engines/q05-dense --device cuda --lengths 8k,16k,32k \
    --tasks niah_single_2,niah_multikey_1,qa_1 --samples 2 --reps 3 --token-drop "auto=$DROP" \
    --token-drop "late4=$DROP,drop_layers=11:14:17:20" --token-drop "authors=$AUTHORS" --json $W/token_drop_ttft.json 2>&1 | tail -n 20
  exit 0
fi
if [ "$MODE" = sweep ]; then
  parity 32768 &  # hip-attn parity at 32K beside the sweep
  declare -A COLS=([dense]="" [auto]="$DROP" [late4]="$DROP,drop_layers=11:14:17:20" [k5to7]="$DROP,drop_layers=14:17:20"
    [auto_p98]="p=0.98,min_prompt_len=4096")
  for L in 8k 16k 32k; do
    for c in "${!COLS[@]}"; do
      if [ -z "${COLS[$c]}" ]; then ruler $c $L & else ruler $c $L --token-drop "${COLS[$c]}" & fi
    done
    wait $(jobs -p | tail -n ${#COLS[@]}); echo "sweep $L done at ${SECONDS}s"
  done
  wait; cat $W/cut.txt 2>/dev/null
  for f in $W/ruler_*.md; do  # one line per column and length: mean over the 9 tasks, retention
    echo "$(basename $f .md) $(grep -E 'mean|retention' $f | awk -F'|' '{printf "%s ", $4}')"
  done
  for f in $W/ruler_*.md; do echo "== $(basename $f)"; tail -n 12 $f; done
  grep -v -E "Warn|it/s]" $W/parity_32768.log | tail -n 40
  exit 0
fi
(for L in 8k 16k 32k; do
   ruler dense $L & ruler drop_authors $L --token-drop $AUTHORS & ruler drop_old $L --token-drop $OLD & wait
   echo "ruler $L done at ${SECONDS}s"
 done) &

sleep 5
parity 32768
parity 131072
wait
echo "all done at ${SECONDS}s"; cat $W/cut.txt 2>/dev/null
for f in $W/ruler_*.md; do echo "== $(basename $f)"; tail -n 14 $f; done
for f in $W/parity_*.log; do echo "== $(basename $f)"; tail -n 40 $f; done
