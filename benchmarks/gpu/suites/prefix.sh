#!/usr/bin/env bash
# suite: prefix caching on a 1M-token document, token drop's 128K TTFT, 3k-flash decode at 512K per chunk score
# One device call (under 9 minutes on an H200): prefix caching on a 1M-token document,
# then token drop's 128K TTFT with its kernels in the engine, then 3k-flash decode at 512K under
# each chunk score (the default's speed side). Logs and JSON under $OUT.
#   bash benchmarks/gpu/run.sh prefix            (on the H200, repo root)
set -o pipefail
OUT=${OUT:-/tmp/infhip-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
left() { echo $(( ${DEADLINE_S:-520} - $(date +%s) + T0 )); }
python3 -m benchmarks.speed.bench_prefix_cache --out "$OUT/prefix" --deadline-s ${PREFIX_S:-330} 2>&1 \
  | grep -v -E "Warning|warn_once" | tee "$OUT/prefix.log" | tail -30
L=$(left); if (( L > 60 )); then timeout -s INT $(( L < 90 ? L : 90 )) python3 -m benchmarks.speed.bench_token_drop \
  --out "$OUT/token_drop" --models llama-3.1-8b --lengths 128k --retention 0.3 --spare-anchors 1 --drop-layers every 2>&1 \
  | grep -v -E "Warning|warn_once" | tee "$OUT/token_drop.log" | tail -6; else echo "SKIPPED token drop"; fi
L=$(left); if (( L > 60 )); then timeout -s INT $L python3 -m benchmarks.speed.bench_decode_e2e --out "$OUT/e2e" \
  --contexts 512000 --configs "dense,3k-flash max,3k-flash head_normalized" --kv-gib 72 2>&1 \
  | grep -v -E "Warning|warn_once" | tee "$OUT/e2e.log" | tail -8; else echo "SKIPPED e2e chunk score"; fi
echo "total $(( $(date +%s) - T0 )) s"
