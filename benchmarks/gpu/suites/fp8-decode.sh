#!/usr/bin/env bash
# suite: fp8 weights' open questions: kernel tests, the M = 1 GEMV sweep, 3k-flash + fp8 KV decode at 1K / 1M / largest resident
# One device call (one H200, ends by ~530 s; TESTS_S=0: ~390 s) for fp8 weights' open questions
# (docs/fp8_weights.md "Speed"):
#   1. install infhip (offline); the fp8 kernel tests compiled on the GPU (every GEMV candidate,
#      every e4m3 byte through the table's GEMV: what would show flushed subnormals);
#   2. the M = 1 GEMV sweep: every GEMV_CANDIDATES entry against the table's config and bf16
#      cuBLAS on Llama-8B's qkv, o, gate_up, down and LM head (bench_fp8_weights.py --gemv-sweep);
#   3. 3k-flash + fp8 KV with fp8 weights (bench_decode_e2e.py): decode at 1K and 1M (goal: 1M
#      >= 0.9x of 1K), and the largest context the runtime holds resident (--max-resident: its own
#      KV budgeting with these weights), decoded there too.
# Each step under its own deadline; a short table last. Logs and JSON under $OUT.
#   bash benchmarks/gpu/run.sh fp8-decode            (on the H200, repo root)
set -o pipefail
OUT=${OUT:-/tmp/infhip-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
until_s() { local s=$(( $1 - $(date +%s) + T0 )); echo $(( s < 10 ? 10 : s )); }  # seconds to mark $1, >= 10
quiet() { grep -v -E "Warning|warn_once"; }

python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

T1=${TESTS_S:-140}  # the tests' share; TESTS_S=0 skips them (the sweep checks each result itself)
if (( T1 > 0 )); then
  echo "== 1. fp8 kernel tests (until ${T0}+${T1} s)"
  timeout "$(until_s $T1)" python3 -m pytest -q tests/test_fp8_skinny_gemm.py 2>&1 | tail -15 | tee "$OUT/gpu_fp8_tests.log"
fi

echo "== 2. GEMV sweep (stops starting configs after its budget; the timeout is the backstop)"
BUDGET=$(( $(until_s $((T1 + 130))) - 15 )); BUDGET=$(( BUDGET > 120 ? 120 : BUDGET ))
timeout "$(until_s $((T1 + 145)))" python3 -m benchmarks.speed.bench_fp8_weights --out "$OUT" --gemv-sweep --sweep-budget-s "$BUDGET" \
  2>&1 | quiet > "$OUT/gemv_sweep.log"
tail -3 "$OUT/gemv_sweep.log"

echo "== 3. 3k-flash + fp8 KV, fp8 weights: 1K, 1M, largest resident context"
timeout "$(until_s $((T1 + ${E2E_S:-240} + 145)))" python3 -m benchmarks.speed.bench_decode_e2e --out "$OUT/e2e_fp8" --work /tmp/infhip-e2e-fp8 \
  --contexts 1024,1000000 --configs dense,3k-flash --kv-dtype fp8 --weight-dtype fp8 --max-resident \
  2>&1 | quiet > "$OUT/decode_e2e_fp8.log"
grep -E "max resident|built and loaded|Error|error" "$OUT/decode_e2e_fp8.log" | tail -5

echo "== summary ($(( $(date +%s) - T0 )) s)"
python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
sweep = out / "bench_fp8_gemv_sweep.json"
if sweep.is_file():
    import benchmarks.speed.bench_fp8_weights as b
    res = json.loads(sweep.read_text())
    b.print_sweep_matrix(res)
    b.print_sweep_summary(res)
else:
    print("no GEMV sweep result (see gemv_sweep.log)")
e2e = out / "e2e_fp8" / "bench_decode_e2e.json"
if not e2e.is_file():
    sys.exit("no decode result (see decode_e2e_fp8.log)")
r = json.loads(e2e.read_text())
print(f"\nfp8 weights + fp8 KV, batch 1, fused tok/s ({r.get('gpu')}; goal: 3k-flash at 1M >= 0.9x of 1K):")
ctx = r["contexts"]
short = ctx.get(min(ctx, key=int)) if ctx else None
for n, rows in ctx.items():
    cells = "  ".join(f"{name} {row['fused8_tok_s']:.1f} ({row['median_ms']:.2f} ms/step"
                      + (f", {row['fused8_tok_s'] / short[name]['fused8_tok_s']:.2f}x of {min(ctx, key=int)}" if short else "")
                      + ")" for name, row in rows.items())
    print(f"  {int(n):>8}: {cells}")
m = r.get("max_resident")
if m:
    print(f"largest resident context (runtime budget, fp8 weights {m['weights_gib']:.1f} GiB): {m['max_seq_len']} tokens; "
          f"pages allocated {m.get('allocated_pages', 'not loaded')}")
if "load_error" in r:
    print("load at that length failed:", r["load_error"][:300])
EOF
