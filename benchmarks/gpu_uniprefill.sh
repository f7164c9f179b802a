#!/usr/bin/env bash
# UniPrefill on Qwen2.5-Coder-0.5B on the H200 (issue 32): RULER's 9 tasks at 8K / 16K / 32K,
# 5 prompts per task (45 per length, the same prompts in every column), for dense, the default
# token drop (the authors' schedule: drop_layers=auto, after attention, no re-entry) and the
# earlier schedule (every full layer from the second on, before attention, re-entry); then time
# to first token on real prompts at the retention each reaches (benchmarks/uniprefill_ttft.py).
# Needs the GGUF and the Python parts staged as for `bash benchmarks/gpu_quality.sh qwen`
# (benchmarks/stage_qwen.sh: .stage/qwen05/ parts + .stage/qwen-pylib.tar.gz).
#   bash benchmarks/gpu_uniprefill.sh ruler   the three RULER columns side by side (~8 min)
#   bash benchmarks/gpu_uniprefill.sh ttft    TTFT of the three on 8K-32K prompts (next call, warm machine)
# Raw JSON and markdown in $OUT.
set -eo pipefail
OUT=${OUT:-/tmp/infhip-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
tar -xzf .stage/qwen-pylib.tar.gz -C .stage  # -> .stage/pylib-qwen: gguf, wonderwords, RULER data
export PYTHONPATH=$PWD/.stage/pylib-qwen:$PYTHONPATH INFHIP_CACHE=$PWD/.stage/cache
[ -f .stage/cache/qwen2.5-coder-0.5b-instruct.gguf ] || \
  python3 -m infhip.eval.stage join-file .stage/qwen05 .stage/cache/qwen2.5-coder-0.5b-instruct.gguf
[ -d engines/q05-dense ] || infhip-build --model qwen2.5-coder-0.5b --preset dense --dtype bfloat16 \
  --max-seq-len 33024 --device cuda --output engines/q05-dense --force --quiet

G="--device cuda --kv-cache-memory-bytes 16GiB"
ALL=niah_single_1,niah_single_2,niah_multikey_1,niah_multivalue,niah_multiquery,vt,cwe,fwe,qa_1
# min_prompt_len 4096: the default 8192 would leave the "8K" prompts (8192 - generated) whole
TD="p=0.99,min_prompt_len=4096"
OLD="$TD,drop_layers=every,drop_point=before_attention,reenter=true,spare_anchors=1"

case ${1:-ruler} in
ruler)
  infhip-eval ruler --engine engines/q05-dense $G --template chat --tasks $ALL --lengths 8k,16k,32k --samples 5 \
      --json $OUT/ruler_dense.json --markdown $OUT/ruler_dense.md > $OUT/ruler_dense.log 2>&1 &
  infhip-eval ruler --engine engines/q05-dense $G --token-drop $TD --template chat --tasks $ALL \
      --lengths 8k,16k,32k --samples 5 --json $OUT/ruler_td_default.json --markdown $OUT/ruler_td_default.md \
      > $OUT/ruler_td_default.log 2>&1 &
  infhip-eval ruler --engine engines/q05-dense $G --token-drop $OLD --template chat --tasks $ALL \
      --lengths 8k,16k,32k --samples 5 --json $OUT/ruler_td_old.json --markdown $OUT/ruler_td_old.md \
      > $OUT/ruler_td_old.log 2>&1 &
  wait
  for f in $OUT/ruler_*.json; do gzip -f "$f"; done  # the prompts' text makes them MBs
  tail -n 30 $OUT/ruler_*.md
  ;;
ttft)
  python3 benchmarks/uniprefill_ttft.py --engine engines/q05-dense --device cuda --lengths 8k,16k,32k \
      --tasks niah_single_2,niah_multikey_1,qa_1 --samples 2 --reps 3 --td "default=$TD" --td "old=$OLD" \
      --json $OUT/uniprefill_ttft.json
  ;;
*) echo "usage: bash benchmarks/gpu_uniprefill.sh ruler|ttft" >&2; exit 2 ;;
esac
