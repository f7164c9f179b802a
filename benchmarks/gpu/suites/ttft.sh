#!/usr/bin/env bash
# suite: 1.04M-token TTFT of 3k-flash + fp8 KV, bf16 and fp8 weights, per 32K chunk (ttft_breakdown; ~7 min)
# One device call: the 1.04M-token TTFT of `3k-flash` + fp8 KV (Llama-3.1-8B shapes,
# random weights) with bf16 and fp8 weights, plain and broken down per 32K chunk
# (benchmarks/speed/ttft_breakdown.py; about 7 minutes on an H200 by the figures in docs/benchmarks.md:
# two AOT builds of ~62 s, two 1.04M prefills of ~65 s per weight dtype). Logs and JSON under $OUT.
#   bash benchmarks/gpu/run.sh ttft [--prompt-lens 1040000,131072] [--weights bf16,fp8] [--no-plain]
set -o pipefail
OUT=${OUT:-/tmp/infhip-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -m benchmarks.speed.ttft_breakdown --out "$OUT" "$@" 2>&1 | grep -v -E "Warning|warn_once" \
  | tee "$OUT/ttft_breakdown.log" | tail -120
