#!/usr/bin/env bash
# Stage vLLM 0.20.0 onto the H200 machine for benchmarks/peers/bench_vs_vllm.py. Run it here,
# in the checkout whose tree the device calls send, with the project's venv active (it needs pip
# and `packaging`; vLLM is not a project dependency and is never installed here).
#
#   bash benchmarks/gpu/stage/vllm.sh [--skip NAME[,NAME]]   download, check, pack, split; print the calls
#   bash benchmarks/gpu/stage/vllm.sh --dry-run [--skip ...] check the wheels already in .whl/vllm against
#                                                        their metadata; print the calls; write nothing
#   bash benchmarks/gpu/stage/vllm.sh --unpack               THERE, in the call carrying the last part:
#                                                        join, check, pip install into /tmp/site,
#                                                        import vLLM's CUDA extensions
#
# What travels: the wheels benchmarks/peers/vllm_wheels.py resolves (vLLM's Requires-Dist read
# recursively, stopping at the packages the machine's image has: machine_packages.txt) plus
# its plan.json, packed into one tar (wheels are zips already: no compression) and cut by
# `python -m infhip.eval.stage split-file` into parts that fit one call beside the tree. On
# 2026-12-04: 100 wheels, 782.9 MiB, of which flashinfer-cubin 281.5 MiB (precompiled kernels for
# FlashInfer's TRT-LLM paths; --skip flashinfer-cubin leaves it out: see
# docs/results/2026-12-04/vllm-staging.md for when that is safe). vLLM's extensions need libcudart.so.13, the machine's CUDA 13
# runtime (readelf NEEDED of vllm/_C.abi3.so and the FA3 library), so no CUDA wheel travels.
# Device calls: back to back (the machine keeps ignored files only while warm, 30 s idle), each
# carrying one part; the last runs `bash benchmarks/gpu/run.sh vllm --parts offline`, which unpacks.
set -euo pipefail
cd "$(dirname "$0")/../../.."
WHEELS=.whl/vllm
STAGE=.stage/vllm
TAR=.stage/vllm-wheels.tar
MODE=stage
SKIP=""
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) MODE=dry ;;
    --unpack) MODE=unpack ;;
    --skip) SKIP=$2; shift ;;
    *) echo "benchmarks/gpu/stage/vllm.sh: unknown argument $1 (--dry-run | --unpack | --skip NAME[,NAME])" >&2; exit 2 ;;
  esac
  shift
done

if [ "$MODE" = unpack ]; then
  # On the GPU machine: python3 is the image's (torch 2.11.0+cu130); stage.py imports nothing of infhip.
  python3 eval/stage.py join-file "$STAGE" /tmp/vllm-wheels.tar
  rm -rf /tmp/vllm-wheels && mkdir -p /tmp/vllm-wheels && tar -xf /tmp/vllm-wheels.tar -C /tmp/vllm-wheels
  # install prints every requirement edge the machine's versions do not meet ([kept: ...] = on purpose)
  python3 -m benchmarks.peers.vllm_wheels install --dir /tmp/vllm-wheels --target /tmp/site || echo "WARNING: unmet requirements above"
  PYTHONPATH=/tmp/site python3 -c "
import torch, vllm, vllm._C  # vllm._C: the CUDA ops, linked against libcudart.so.13
from vllm.vllm_flash_attn import flash_attn_varlen_func  # FA3, vLLM's attention on Hopper
print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())"
  echo "vLLM staged: export PYTHONPATH=/tmp/site (bench_vs_vllm.py does)"
  exit 0
fi

# Part size: what a call carries (64 MiB) less the tree that travels with every call, less 2 MiB
# for the tree growing between now and the GPU session; at most the 60 MiB stage.py allows.
tree_bytes=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
part_mib=$(python -c "print(min(60, int(64 - $tree_bytes / 2**20 - 2)))")

if [ "$MODE" = stage ]; then
  python -m benchmarks.peers.vllm_wheels resolve --dir "$WHEELS"
fi
python -m benchmarks.peers.vllm_wheels check --dir "$WHEELS"

files=$(python - "$WHEELS" "$SKIP" <<'EOF'
import json, sys
from packaging.utils import canonicalize_name
plan = json.load(open(f"{sys.argv[1]}/plan.json"))
skip = {canonicalize_name(s) for s in sys.argv[2].split(",") if s}
unknown = skip - set(plan["wheels"])
if unknown:
    raise SystemExit(f"--skip names no staged wheel: {sorted(unknown)}")
print(" ".join(w["file"] for n, w in plan["wheels"].items() if n not in skip))
EOF
)
total=$(cd "$WHEELS" && du -cb plan.json $files | tail -1 | cut -f1)
nparts=$(python -c "import math; print(math.ceil($total / ($part_mib * 2**20)))")
echo "tree $((tree_bytes >> 20)) MiB; $(echo $files | wc -w) wheels + plan.json = $((total >> 20)) MiB" \
     "-> $nparts parts of $part_mib MiB${SKIP:+ (left out: $SKIP)}"

if [ "$MODE" = stage ]; then
  mkdir -p .stage
  # --skip still writes the full plan.json: `install` then reports the left-out names as not installed
  (cd "$WHEELS" && tar -cf "../../$TAR" plan.json $files)
  python -m infhip.eval.stage split-file "$TAR" --name vllm --part-mib "$part_mib" > /dev/null
  rm -f "$TAR"
  parts=$(python -c "import json; print(' '.join(p['path'] for p in json.load(open('$STAGE/manifest.json'))['parts']))")
else
  parts=$(for i in $(seq 0 $((nparts - 1))); do printf "parts/vllm-wheels.tar.%03d " "$i"; done)
fi
set -- $parts
n=$#
echo "Device calls, back to back (kind nvidia-h200; each carry = one path list):"
i=1
for p in "$@"; do
  if [ $i -eq 1 ]; then carry="$STAGE/manifest.json $STAGE/$p"; else carry="$STAGE/$p"; fi
  if [ $i -lt $n ]; then
    echo "  $i/$n: carry [$carry]; command: ls -l $STAGE/parts"
  else
    echo "  $i/$n: carry [$carry]; command: bash benchmarks/gpu/run.sh vllm --parts offline (unpacks first)"
  fi
  i=$((i + 1))
done
