#!/usr/bin/env bash
# suite: real-model quality from staged engines: CASE = smol | gemma | qwen | qwen-knobs | ... (default smol)
# Real-model quality on the H200 from engines staged on this machine
# (python -m infhip.eval.stage split ENGINE; one part per device call, the KJV package copied to
# .stage/pylib), joined here. See docs/quality.md for the staging calls.
#   bash benchmarks/gpu/run.sh quality smol     SmolLM2-135M bf16: dense plan vs 3k plan, 4K-32K
#   bash benchmarks/gpu/run.sh quality gemma    Gemma-3-270M bf16: dense baselines, 1K-32K
#   bash benchmarks/gpu/run.sh quality smol-chunk-score   SmolLM2 3k: chunk_score max vs head_normalized
#   bash benchmarks/gpu/run.sh quality smol-query-stride  SmolLM2 3k: prefill query strides 1,1,1 vs 4,4,1 vs 4,4,4
#   bash benchmarks/gpu/run.sh quality smol-stage3-stride SmolLM2 3k: NIAH 8K-32K with query strides 4,4,1 vs 4,4,4
#   bash benchmarks/gpu/run.sh quality smol-layer-bisect  SmolLM2 3k, 8K passkey: pruning in all / lower / upper layers
#   bash benchmarks/gpu/run.sh quality qwen     Qwen2.5-Coder-0.5B from the GGUF staged by benchmarks/gpu/stage/qwen.sh
#                                           RULER/passkey/ppl/recall/token drop, ~9 min
#   bash benchmarks/gpu/run.sh quality qwen-knobs          the same GGUF: 3k/5k x chunk_score, RULER NIAH 32K/128K
#   bash benchmarks/gpu/run.sh quality qwen-knobs-passkey  the next call on the warm machine: PG passkey, recall
#   bash benchmarks/gpu/run.sh quality qwen-budget         the same GGUF: 5k with 8K final keys, 3k with more special
#                                           layers (NIAH, passkey), recall of 5k and 5k-8k
#   bash benchmarks/gpu/run.sh quality qwen-rope           5k: pruning RoPE chunk_indexed / none, stage 1 of 64K keys
#   bash benchmarks/gpu/run.sh quality qwen-special        5k and 5k-8k with special_final_k 16384
#   (the hip-attn parity at 32K/128K: bash benchmarks/gpu/run.sh window suspects)
set -eo pipefail
OUT=${OUT:-/tmp/infhip-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/.stage/pylib:$PYTHONPATH
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3

join() {  # join() STAGE_NAME: engines/STAGE_NAME from .stage/STAGE_NAME (once)
  [ -d engines/$1 ] || python3 -m infhip.eval.stage join .stage/$1 engines/$1
}

retrieval() {  # retrieval "ENGINE ARGS" TAG: passkey 8K-32K (3 depths x 5) + NIAH 16K-32K (3 depths x 3)
  infhip-eval passkey $1 --lengths 8k,16k,32k --depths 0.1,0.5,0.9 --samples 5 \
      --json $OUT/passkey_$2.json --markdown $OUT/passkey_$2.md
  infhip-eval niah $1 --lengths 16k,32k --variants single,multikey --depths 0.25,0.5,0.75 --samples 3 \
      --json $OUT/niah_$2.json
}

# Qwen2.5-Coder-0.5B-Instruct (24 layers, 32K trained window), one call of < 10 min per case. Steps
# run in priority order, three at a time (a 0.5B model leaves the GPU mostly idle); each gets the
# time left before the deadline (a cut step loses only its own JSON). Raw JSON + markdown go to
# $W and come back as $OUT/ruler_*.json.gz + $OUT/qwen_raw.tar.gz.
qwen_setup() {  # the staged GGUF joined and checked, the Python parts the GPU image lacks
  W=/tmp/qwen-results; mkdir -p $W engines; DEADLINE=${DEADLINE:-540}
  # Whatever was written comes back, even after an error: each RULER JSON (the prompts' text makes
  # them MBs) gzipped on its own, the rest in one tarball (at most 8 files of 16 MiB come back).
  trap 'for f in $W/ruler_*.json; do [ -f "$f" ] && gzip -c "$f" > $OUT/$(basename $f).gz; done
        tar -czf $OUT/qwen_raw.tar.gz --exclude="ruler_*.json" -C $W .' EXIT
  tar -xzf .stage/qwen-pylib.tar.gz -C .stage  # -> .stage/pylib-qwen: gguf, wonderwords, RULER data
  export PYTHONPATH=$PWD/.stage/pylib-qwen:$PYTHONPATH INFHIP_CACHE=$PWD/.stage/cache
  python3 -m infhip.eval.stage join-file .stage/qwen05 .stage/cache/qwen2.5-coder-0.5b-instruct.gguf
  python3 -c "from infhip.builder.registry import resolve_model as r; print(r('qwen2.5-coder-0.5b'))"  # pinned SHA-256
}
qwen_build() {  # qwen_build PRESET...: engines/q05-PRESET, built at once, then engines/q05-dense
  # max_seq_len 131136: a 128K passkey prompt plus its 8 generated tokens must fit. dense_threshold
  # 4096 at build (the default, 32K, would make the 32K column the dense one): as a load-time
  # override it launches variants the build did not compile (sparse inside the trained window).
  for p in "$@"; do
    infhip-build --model qwen2.5-coder-0.5b --preset $p --dtype bfloat16 --max-seq-len 131136 --device cuda \
        --infinitehip-overrides dense_threshold=4096 --output engines/q05-$p --force --quiet > $W/build_$p.log 2>&1 &
  done
  wait
  tail -n 2 $W/build_*.log  # "engine written to ... in N s", or the error
  rm -rf engines/q05-dense && python3 -m benchmarks.quality.replan_engine engines/q05-$1 engines/q05-dense --sparse none
  echo "engines ready at ${SECONDS}s"
}
qwen_knob_engines() {  # engines/q05-3k (built once per warm machine) and q05-5k, its weights replanned
  [ -d engines/q05-3k ] || qwen_build 3k
  [ -d engines/q05-5k ] || python3 -m benchmarks.quality.replan_engine engines/q05-3k engines/q05-5k --sparse all --preset 5k
}
qwen_finish() {  # the GPU's name and the summary table, printed last and in $OUT/qwen_summary.md
  echo "evals done at ${SECONDS}s"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $W/gpu.txt
  python3 -m benchmarks.quality.qwen_summary $W | tee $OUT/qwen_summary.md
}
qwen_variants() {  # qwen_variants NIAH_LENGTHS PASSKEY_LENGTHS NAME...: RULER NIAH (4 prompts per task)
  # and PG passkey (5 depths x 2) of each engines/q05-NAME, as background steps (the caller waits)
  local niah=$1 passkey=$2; shift 2
  for e in "$@"; do
    step ruler_$e infhip-eval ruler --engine engines/q05-$e $G --template chat --tasks $NIAH --lengths $niah \
        --samples 4 --json $W/ruler_$e.json --markdown $W/ruler_$e.md &
    step passkey_$e infhip-eval passkey --engine engines/q05-$e $G --haystack pg --lengths $passkey \
        --depths $DEPTHS --samples 2 --json $W/passkey_$e.json --markdown $W/passkey_$e.md &
  done
}
step() {  # step NAME CMD...: run CMD with the time left before the deadline; its log in $W/NAME.log
  local left=$((DEADLINE - SECONDS)) rc=0
  if [ $left -le 20 ]; then echo "SKIPPED $1 (deadline)" | tee -a $W/skipped.txt; return; fi
  echo "== $1 (at ${SECONDS}s, ${left}s left)"
  timeout $left "${@:2}" > $W/$1.log 2>&1 || rc=$?
  echo "== $1 done at ${SECONDS}s"; grep -v -E "Warning|warn|compiling" $W/$1.log | tail -n 25 || true
  [ $rc -eq 0 ] || echo "$1 exited $rc at ${SECONDS}s (124: cut at the deadline)" | tee -a $W/skipped.txt
}
G="--device cuda --kv-cache-memory-bytes 16GiB"
NIAH=niah_single_1,niah_single_2,niah_multikey_1,niah_multivalue,niah_multiquery
DEPTHS=0.1,0.3,0.5,0.7,0.9

case ${1:-smol} in
smol)
  S=engines/smol-3k-bf16; D=engines/smol-dense-bf16
  join smol-3k-bf16
  [ -d $D ] || python3 -m benchmarks.quality.replan_engine $S $D --sparse none  # same weights, dense plan
  E="--engine $D --engine $S --device cuda --kv-cache-memory-bytes 16GiB"
  infhip-eval passkey $E --lengths 4k,8k,16k,32k --depths 0.1,0.5,0.9 --samples 5 \
      --json $OUT/passkey_smol_gpu.json --markdown $OUT/passkey_smol_gpu.md --plot $OUT/passkey_smol_gpu.png
  infhip-eval recall --engine $S --device cuda --kv-cache-memory-bytes 16GiB --lengths 8k,16k,32k --chunk 64 \
      --json $OUT/recall_smol_gpu.json
  infhip-eval ppl $E --lengths 16k,32k --chunk 256 --samples 2 --json $OUT/ppl_smol_gpu.json
  infhip-eval niah $E --lengths 16k,32k --variants single,multikey --depths 0.5 --samples 3 \
      --json $OUT/niah_smol_gpu.json
  ;;
smol-chunk-score)
  S=engines/smol-3k-bf16
  join smol-3k-bf16
  for score in max head_normalized; do
    retrieval "--engine $S --device cuda --kv-cache-memory-bytes 16GiB --infinitehip-overrides chunk_score=$score" smol_3k_$score
  done
  ;;
smol-query-stride)  # prefill query strides: the paper's formula (1,1,1) vs its public code's (4,4,1) and 4,4,4
  S=engines/smol-3k-bf16
  join smol-3k-bf16
  for strides in 1,1,1 4,4,1 4,4,4; do
    E="--engine $S --device cuda --kv-cache-memory-bytes 16GiB --infinitehip-overrides query_strides=[$strides]"
    tag=${strides//,/}
    retrieval "$E" smol_3k_s$tag
    infhip-eval ppl $E --lengths 16k,32k --chunk 256 --samples 2 --json $OUT/ppl_smol_3k_s$tag.json
  done
  ;;
smol-stage3-stride)  # the last stage scored by every query (4,4,1, the presets) or every 4th (4,4,4): NIAH only
  S=engines/smol-3k-bf16
  join smol-3k-bf16
  for strides in 4,4,1 4,4,4; do
    tag=${strides//,/}
    infhip-eval niah --engine $S --device cuda --kv-cache-memory-bytes 16GiB --infinitehip-overrides query_strides=[$strides] \
        --lengths 8k,16k,32k --variants single,multikey --depths 0.1,0.3,0.5,0.7,0.9 --samples 3 \
        --json $OUT/niah_smol_3k_s$tag.json --markdown $OUT/niah_smol_3k_s$tag.md
  done
  ;;
smol-layer-bisect)  # which layers' pruning loses the 8K passkey: pruning in every layer, only
  # the lower half (upper half dense), only the upper half; 8K keeps every dense layer in its window
  S=engines/smol-3k-bf16
  join smol-3k-bf16
  for half in low high; do  # the same weights, half of the layers dense
    [ -d engines/smol-3k-$half-only ] || python3 -m benchmarks.quality.replan_engine $S engines/smol-3k-$half-only --sparse $half
  done
  E="--engine $S --engine engines/smol-3k-low-only --engine engines/smol-3k-high-only --device cuda --kv-cache-memory-bytes 16GiB"
  infhip-eval passkey $E --infinitehip-overrides query_strides=[4,4,1] --lengths 8k --depths 0.1,0.5 --samples 5 \
      --json $OUT/passkey_smol_bisect.json --markdown $OUT/passkey_smol_bisect.md
  ;;
gemma)
  G=engines/gemma-dense-bf16
  join gemma-dense-bf16
  E="--engine $G --device cuda --kv-cache-memory-bytes 16GiB"
  infhip-eval passkey $E --lengths 1k,2k,4k,8k,16k,32k --depths 0.1,0.5,0.9 --samples 5 \
      --json $OUT/passkey_gemma_gpu.json --plot $OUT/passkey_gemma_gpu.png
  infhip-eval ppl $E --lengths 1k,2k,4k,8k --chunk 256 --samples 2 --json $OUT/ppl_gemma_gpu.json
  infhip-eval niah $E --lengths 4k,16k,32k --variants single,multikey --depths 0.5 --samples 3 \
      --json $OUT/niah_gemma_gpu.json
  ;;
qwen)  # the baselines: dense RULER/passkey to 32K, 3k / 3k-flash / 5k to 128K, token drop,
  # perplexity, recall; the summary table printed last and written to $OUT/qwen_summary.md. First
  # run (2026-12-02, docs/quality.md): builds 148 s, and one step after another did not fit 500 s.
  qwen_setup
  qwen_build 3k 3k-flash 5k
  IH="--engine engines/q05-3k --engine engines/q05-3k-flash --engine engines/q05-5k $G --infinitehip-overrides dense_threshold=4096"
  ALL=$NIAH,vt,cwe,fwe,qa_1
  # (RULER in the model's chat template: an instruct model; the answer prefix opens its turn.)
  # Three groups of three concurrent steps (the first run: ruler_ih alone took 171 s, the
  # token-drop pair 81 s and the ppl/recall trio 66 s when run side by side).
  step ruler_ih infhip-eval ruler $IH --template chat --tasks $NIAH --lengths 32k,64k,128k --samples 2 \
      --json $W/ruler_ih.json --markdown $W/ruler_ih.md &
  step ruler_dense infhip-eval ruler --engine engines/q05-dense $G --template chat --tasks $ALL --lengths 8k,16k,32k \
      --samples 4 --json $W/ruler_dense.json --markdown $W/ruler_dense.md &
  step passkey_dense infhip-eval passkey --engine engines/q05-dense $G --haystack pg --lengths 8k,16k,32k \
      --depths $DEPTHS --samples 2 --json $W/passkey_dense.json --markdown $W/passkey_dense.md &
  wait
  step passkey_ih infhip-eval passkey $IH --haystack pg --lengths 32k,64k,128k --depths $DEPTHS --samples 1 \
      --json $W/passkey_ih.json --markdown $W/passkey_ih.md &
  for p in 0.99 0.98; do  # min_prompt_len 4096: the default 8192 would leave the "8K" prompts (8192 - generated) whole
    step ruler_drop$p infhip-eval ruler --engine engines/q05-dense $G --token-drop p=$p,min_prompt_len=4096 --template chat --tasks $ALL \
        --lengths 8k,16k,32k --samples 2 --json $W/ruler_drop$p.json --markdown $W/ruler_drop$p.md &
  done
  wait
  step ppl_ih infhip-eval ppl $IH --haystack pg --lengths 32k,64k,128k --chunk 256 --samples 1 \
      --json $W/ppl_ih.json --markdown $W/ppl_ih.md &
  step ppl_dense infhip-eval ppl --engine engines/q05-dense $G --haystack pg --lengths 32k,64k --chunk 256 \
      --samples 1 --json $W/ppl_dense.json --markdown $W/ppl_dense.md &
  step recall_3k infhip-eval recall --engine engines/q05-3k $G --haystack pg --lengths 8k,16k,32k --chunk 64 \
      --json $W/recall_3k.json --markdown $W/recall_3k.md &  # pg: the GPU image has no KJV package
  wait
  qwen_finish
  ;;
qwen-knobs)  # the qwen case's follow-up. CPU needle coverage (docs/results/2026-12-02-qwen/needle-coverage.md): 3k loses
  # the needle in stage 3 at 16K and from stage 2 at 32K; head_normalized mixed. Here: 3k and 5k
  # (the 3k weights replanned; its kernels compile at load) under chunk_score head_normalized (the
  # default) and max, RULER NIAH with 4 prompts per task (20 per length; at 32K the dense
  # baseline's prompts) at 32K and 128K, four processes at once. The engines stay on a warm
  # machine: `qwen-knobs-passkey` in the next call reuses them.
  qwen_setup
  qwen_knob_engines
  for e in 3k 5k; do
    for score in head_normalized max; do
      step ruler_${e}_$score infhip-eval ruler --engine engines/q05-$e $G --infinitehip-overrides chunk_score=$score \
          --template chat --tasks $NIAH --lengths 32k,128k --samples 4 \
          --json $W/ruler_${e}_$score.json --markdown $W/ruler_${e}_$score.md &
    done
  done
  wait
  qwen_finish
  ;;
qwen-knobs-passkey)  # the same engines and knobs: PG passkey at 32K-128K, 5 depths x 2, and the
  # 3k engine's attention recall of the final masks at 8K-32K
  qwen_setup
  qwen_knob_engines
  for e in 3k 5k; do
    for score in head_normalized max; do
      step passkey_${e}_$score infhip-eval passkey --engine engines/q05-$e $G --infinitehip-overrides chunk_score=$score \
          --haystack pg --lengths 32k,64k,128k --depths $DEPTHS --samples 2 \
          --json $W/passkey_${e}_$score.json --markdown $W/passkey_${e}_$score.md &
    done
  done
  step recall_3k infhip-eval recall --engine engines/q05-3k $G --haystack pg --lengths 8k,16k,32k --chunk 64 \
      --json $W/recall_3k.json --markdown $W/recall_3k.md &
  wait
  qwen_finish
  ;;
qwen-budget)  # after qwen-knobs (2026-12-03, docs/quality.md): 5k beats 3k at 128K (NIAH 72.5 vs 32.5)
  # and 3k's final-mask recall is 0.94-0.88 at 8K-32K, lowest in layers 0, 3, 16, 22 (the needle
  # is lost in 9 and 11 on the CPU). Is it the budget? 5k with a final stage of 8192 keys (5k-8k),
  # and 3k with those layers special (4096 final keys, chunk-indexed pruning RoPE), all under the
  # default chunk_score; the prompts are qwen-knobs' (same seeds).
  qwen_setup
  qwen_knob_engines
  python3 -m benchmarks.quality.replan_engine engines/q05-3k engines/q05-5k-8k --sparse all --preset 5k \
      --set 'stages=[[64,64,32768],[64,32,16384],[64,16,8192]]'
  python3 -m benchmarks.quality.replan_engine engines/q05-3k engines/q05-3k-sp --sparse all --special 0,1,2,3,9,11,16,22
  qwen_variants 32k,128k 32k,64k,128k 5k-8k 3k-sp
  step recall_5k infhip-eval recall --engine engines/q05-5k --engine engines/q05-5k-8k --engine engines/q05-3k-sp $G \
      --haystack pg --lengths 8k,16k,32k --chunk 64 --json $W/recall_5k.json --markdown $W/recall_5k.md &
  wait
  qwen_finish
  ;;
qwen-rope)  # after qwen-budget: past the window a larger budget does not help (5k and 5k-8k both NIAH 72.5
  # at 128K). The pruning RoPE (relative: the paper's default; chunk_indexed; none) and a stage 1
  # that keeps 64K keys instead of 32K, on 5k; NIAH at 128K and passkey at 64K, 128K.
  qwen_setup
  qwen_knob_engines
  python3 -m benchmarks.quality.replan_engine engines/q05-3k engines/q05-5k-ci --sparse all --preset 5k --set pruning_rope=chunk_indexed
  python3 -m benchmarks.quality.replan_engine engines/q05-3k engines/q05-5k-prn --sparse all --preset 5k --set pruning_rope=none
  python3 -m benchmarks.quality.replan_engine engines/q05-3k engines/q05-5k-s1 --sparse all --preset 5k \
      --set 'stages=[[64,64,65536],[64,32,16384],[64,16,4096]]'
  qwen_variants 128k 64k,128k 5k-ci 5k-prn 5k-s1
  wait
  qwen_finish
  ;;
qwen-special)  # after qwen-budget: layer 0 has the lowest final-mask recall in every variant (0.71 at
  # 32K), and in 5k-8k the special layers 0-2 keep fewer final keys (special_final_k 4096) than
  # the rest (8192). special_final_k 16384 on 5k and on 5k-8k: recall 8K-32K, NIAH, passkey.
  qwen_setup
  qwen_knob_engines
  python3 -m benchmarks.quality.replan_engine engines/q05-3k engines/q05-5k-sk16 --sparse all --preset 5k --set special_final_k=16384
  python3 -m benchmarks.quality.replan_engine engines/q05-3k engines/q05-5k-8k-sk16 --sparse all --preset 5k \
      --set 'stages=[[64,64,32768],[64,32,16384],[64,16,8192]],special_final_k=16384'
  qwen_variants 32k,128k 32k,64k,128k 5k-sk16 5k-8k-sk16
  step recall_sk16 infhip-eval recall --engine engines/q05-5k-sk16 --engine engines/q05-5k-8k-sk16 $G \
      --haystack pg --lengths 8k,16k,32k --chunk 64 --json $W/recall_sk16.json --markdown $W/recall_sk16.md &
  wait
  qwen_finish
  ;;
*) echo "usage: bash benchmarks/gpu/run.sh quality smol|gemma|smol-chunk-score|smol-query-stride|smol-stage3-stride|smol-layer-bisect|qwen|qwen-knobs|qwen-knobs-passkey|qwen-budget|qwen-rope|qwen-special" >&2; exit 2 ;;
esac
