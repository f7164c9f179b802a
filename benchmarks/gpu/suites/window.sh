#!/usr/bin/env bash
# suite: past the trained window (Qwen2.5-0.5B, 32K window): 3k's suspects, every preset vs dense + YaRN, hip-attn parity
#   bash benchmarks/gpu/run.sh window suspects      3k and one change each (5k's stage sizes one at a time, decode
#        refresh, key bank, special layers, sink/window) beside 5k and dense + YaRN x4 at 128K, RULER NIAH (5 x 4); the
#        hip-attn parity (benchmarks/parity/infinitehip.py) at 128K and 32K in the background; ~9 min
#   bash benchmarks/gpu/run.sh window presets LEN   every preset and dense + YaRN x4 at LEN (32k: also dense, the
#        InfiniteHiP presets forced on): RULER NIAH (5 tasks x 8, n = 40) and PG passkey (5 depths x 4, n = 20);
#        one call per length on a warm machine (engines built by the first), 128k first
# Carry: the GGUF parts (benchmarks/gpu/stage/qwen.sh), each part call copying its part to $QWEN_STAGE
#   (default /tmp/qwen05); .stage/qwen-pylib.tar.gz; for `suspects` .whl/hip_attn-1.2.9-py3-none-any.whl.
# Writes under $OUT: window_summary.md (printed last), window_raw.tar.gz (every JSON and log), parity table.
# WINDOW_SCALE=tiny runs the same steps on the CPU with SmolLM2-135M at 512-1K tokens (the parity at 2K) and
# one prompt per cell (tests/test_quality_tools.py, in CI): a suite that breaks on our own Python breaks CI first.
set -eo pipefail
OUT=${OUT:-/tmp/infhip-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
MODE=${1:?usage: bash benchmarks/gpu/run.sh window suspects | presets 32k|64k|128k}
W=${WINDOW_RESULTS:-/tmp/window-results}; mkdir -p $W
trap 'tar -czf $OUT/window_raw.tar.gz -C $W . 2>/dev/null || true' EXIT

if [ "${WINDOW_SCALE:-full}" = tiny ]; then  # CPU, seconds per step: the same commands, small numbers
  MODEL=smollm2-135m; E=${WINDOW_ENGINES:-/tmp/window-engines}/w
  BUILD="--dtype float32 --max-seq-len 1280 --device cpu"; THRESH=256
  G="--device cpu --kv-cache-memory-bytes 256MiB"
  DIAG_LEN=1k; NIAH=niah_single_1; NIAH_N=1; DEPTHS=0.5; PK_N=1; JOBS=1; DEADLINE=${DEADLINE:-1200}
  CAP="--max-new-tokens 4"  # CPU decode of sparse steps runs the float64 references: keep it short
  PARITY="--model smollm2-135m --lengths 2048 --prompts passkey:0.5 --layers 5 --query-blocks 2 --ref-cache contiguous"
  PARITY_ENV="env TRITON_INTERPRET=1"  # their kernels need Triton's interpreter on the CPU
  case ${2:-} in 32k) LEN=512 ;; "") LEN= ;; *) LEN=1k ;; esac
else
  MODEL=qwen2.5-coder-0.5b; E=engines/q05
  # max_seq_len 131136: a 128K prompt plus its generated tokens; dense_threshold 4096 at build: the
  # presets' default (the trained window) would make the 32K column dense, and as a load-time override
  # it launches kernel variants the build did not compile
  BUILD="--dtype bfloat16 --max-seq-len 131136 --device cuda"; THRESH=4096
  G="--device cuda --kv-cache-memory-bytes 10GiB"
  CAP=; DIAG_LEN=128k; NIAH=niah_single_1,niah_single_2,niah_multikey_1,niah_multivalue,niah_multiquery
  NIAH_N=8; DEPTHS=0.1,0.3,0.5,0.7,0.9; PK_N=4; JOBS=4; DEADLINE=${DEADLINE:-540}
  PARITY="--lengths 131072,32768 --prompts niah_single_2:0,passkey:0.5 --template chat --layers all --query-blocks 4"
  LEN=${2:-}
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
  tar -xzf .stage/qwen-pylib.tar.gz -C .stage  # -> .stage/pylib-qwen: gguf, wonderwords, RULER data
  export PYTHONPATH=$PWD/.stage/pylib-qwen:$PYTHONPATH INFHIP_CACHE=$PWD/.stage/cache
  [ -f .stage/cache/qwen2.5-coder-0.5b-instruct.gguf ] || \
    python3 -m infhip.eval.stage join-file ${QWEN_STAGE:-/tmp/qwen05} .stage/cache/qwen2.5-coder-0.5b-instruct.gguf
fi

step() {  # step NAME CMD...: CMD with the time left before the deadline, its log in $W/NAME.log
  local left=$((DEADLINE - SECONDS)) rc=0
  if [ $left -le 20 ]; then echo "SKIPPED $1 (deadline)" | tee -a $W/skipped.txt; return 0; fi
  echo "== $1 (at ${SECONDS}s, ${left}s left)"
  timeout $left "${@:2}" > $W/$1.log 2>&1 || rc=$?
  echo "== $1 done at ${SECONDS}s (rc $rc)"; grep -v -i -E "warn|compiling" $W/$1.log | tail -n 8 || true
  [ $rc -eq 0 ] || echo "$1 exited $rc at ${SECONDS}s (124: cut at the deadline)" | tee -a $W/skipped.txt
}
wanted() {  # wanted NAME: NAME is evaluated (WINDOW_ONLY="a b": only those; CI's short run)
  [ -z "${WINDOW_ONLY:-}" ] || [[ " $WINDOW_ONLY " == *" $1 "* ]]
}
pool() {  # wait until fewer than JOBS background steps run
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
}
build() {  # build NAME ARGS...: $E-NAME from the model (once per warm machine)
  [ -d $E-$1 ] && return 0
  mkdir -p "$(dirname $E)"
  infhip-build --model $MODEL $BUILD --output $E-$1 --force --quiet "${@:2}" > $W/build_$1.log 2>&1 \
    || { tail -n 20 $W/build_$1.log; return 1; }
}
replan() {  # replan NAME ARGS...: $E-NAME, the 3k engine's weights under another plan (kernels compile at load)
  [ -d $E-$1 ] || python3 -m benchmarks.quality.replan_engine $E-3k $E-$1 "${@:2}"
}
niah() {  # niah ENGINE LENGTHS SAMPLES: RULER's NIAH tasks in the chat template -> $W/ruler_ENGINE.json
  step ruler_$1 infhip-eval ruler --engine $E-$1 $G $CAP --template chat --tasks $NIAH --lengths $2 --samples $3 \
      --json $W/ruler_$1.json --markdown $W/ruler_$1.md
}
passkey() {  # passkey ENGINE LENGTHS: PG-essay passkey, 5 depths x PK_N -> $W/passkey_ENGINE.json
  step passkey_$1 infhip-eval passkey --engine $E-$1 $G --haystack pg --lengths $2 --depths $DEPTHS \
      --samples $PK_N --json $W/passkey_$1.json --markdown $W/passkey_$1.md
}
finish() {
  echo "done at ${SECONDS}s"
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $W/gpu.txt
  python3 -m benchmarks.quality.window_summary $W --baseline "$(basename $E)-yarn4" | tee $OUT/window_summary.md
}

IH="--preset 3k --infinitehip-overrides dense_threshold=$THRESH"
case $MODE in
suspects)
  # 3k at 4x the window answers 3 of 20 needles where 5k answers 16 and dense + YaRN 9. One change
  # each, the rest 3k, in the order run (a deadline cuts the last): 5k's three differences one at a
  # time (stage 1 in chunks of 64; the last stage 4096 keys in chunks of 16; stage 2 keeping 16K),
  # decode (refresh every step; no rotated key bank; 3k-flash's (96, 24, 8)), a last stage of 4096
  # keys in chunks of 8, no special layers, sink/window 512 / 2048.
  HIP_WHEEL=${HIP_ATTN_WHEEL:-.whl/hip_attn-1.2.9-py3-none-any.whl}
  if [ -f "$HIP_WHEEL" ]; then
    rm -rf $W/hip-attn && python3 -m zipfile -e "$HIP_WHEEL" $W/hip-attn && mkdir -p $W/parity
    step parity $PARITY_ENV python3 -m benchmarks.parity.infinitehip --hip-attn $W/hip-attn $PARITY --layouts shared \
        --out $W/parity &
  else
    echo "no $HIP_WHEEL: parity not run" | tee -a $W/skipped.txt
  fi
  build 3k $IH & build yarn4 --rope-scaling yarn:4 & wait
  replan 5k --sparse all --preset 5k
  replan 3k-flash --sparse all --preset 3k-flash
  replan 3k-r1 --sparse all --set 'refresh_intervals=[1,1,1]'
  replan 3k-nobank --sparse all --set key_bank=false
  replan 3k-s1c64 --sparse all --set 'stages=[[64,64,32768],[64,32,8192],[64,8,2048]]'
  replan 3k-s3c16 --sparse all --set 'stages=[[64,256,32768],[64,32,8192],[64,16,4096]]'
  replan 3k-s2k16k --sparse all --set 'stages=[[64,256,32768],[64,32,16384],[64,8,2048]]'
  replan 3k-k4096 --sparse all --set 'stages=[[64,256,32768],[64,32,8192],[64,8,4096]]'
  replan 3k-nospecial --sparse all --set 'special_layers=[]'
  replan 3k-sink512-stream2k --sparse all --set n_sink=512,n_stream=2048
  for e in 3k 5k yarn4 3k-s1c64 3k-s3c16 3k-r1 3k-nobank 3k-flash 3k-s2k16k 3k-k4096 3k-nospecial \
           3k-sink512-stream2k; do
    wanted $e || continue
    pool; niah $e $DIAG_LEN $((NIAH_N / 2 > 0 ? NIAH_N / 2 : 1)) &
  done
  wait
  [ -f $W/parity/parity_infinitehip.json ] && python3 -m benchmarks.parity.infinitehip \
      --table-from $W/parity/parity_infinitehip.json > $OUT/parity_table.md && cp $W/parity/parity_infinitehip.json $OUT/
  finish
  ;;
presets)
  [ -n "$LEN" ] || { echo "usage: bash benchmarks/gpu/run.sh window presets 32k|64k|128k" >&2; exit 2; }
  # AOT-built engines (the times are the product's): the four presets and dense + YaRN x4; inside
  # the window (32k) dense as well, the 3k weights under a dense plan
  engines="3k-flash 5k yarn4 3k 3k-fast"
  [ "${2:-}" = 32k ] && engines="$engines dense"
  for p in 3k 3k-fast 3k-flash 5k; do  # dense is the 3k weights under a dense plan
    { wanted $p || { [ $p = 3k ] && wanted dense; }; } && build $p ${IH/3k/$p} &
  done
  wanted yarn4 && build yarn4 --rope-scaling yarn:4 &
  wait
  if wanted dense && [ "${2:-}" = 32k ]; then replan dense --sparse none; fi
  for e in $engines; do
    wanted $e || continue
    pool; { niah $e $LEN $NIAH_N; passkey $e $LEN; } &
  done
  wait
  finish
  ;;
*) echo "usage: bash benchmarks/gpu/run.sh window suspects | presets 32k|64k|128k" >&2; exit 2 ;;
esac
