#!/usr/bin/env bash
# suite: infhip vs vLLM 0.20.0: unpacks the staged wheels (stage/vllm.sh), then bench_vs_vllm --parts ...
# One device call (infhip vs vLLM 0.20.0), after the part-carrying calls that
# `bash benchmarks/gpu/stage/vllm.sh` printed: unpacks vLLM into /tmp/site if this warm machine has
# not yet (the call carrying the last part), installs infhip (offline), then
# benchmarks/peers/bench_vs_vllm.py with the arguments given (--parts offline | serving | cold | memory;
# docs/gpu_runbook.md says which parts fit one 10-minute call).
#   bash benchmarks/gpu/run.sh vllm --parts offline          (on the H200, repo root)
set -o pipefail
OUT=${OUT:-/tmp/infhip-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
if [ ! -d /tmp/site/vllm ]; then
  bash benchmarks/gpu/stage/vllm.sh --unpack 2>&1 | tail -40 | tee "$OUT/stage_vllm_unpack.log" || exit 1
fi
export PYTHONPATH=/tmp/site  # vLLM and its needs; also fastapi / uvicorn / pydantic for infhip-serve
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
python3 -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__, torch.cuda.get_device_name())"
echo "setup: $(( $(date +%s) - T0 )) s"
python3 -m benchmarks.peers.bench_vs_vllm --out "$OUT" "$@" 2>&1 | grep -v -E "Warning|warn_once" \
  | tee "$OUT/bench_vs_vllm.log" | tail -90
