#!/usr/bin/env bash
# The whole CPU test run, at both ends of the supported Triton range (what .ci/run runs, after the
# README's install). The GPU is rarely there to tell us, so everything about the GPU path that
# can be checked without one is checked here:
#   1. the newest Triton (what pip resolved): every engine configuration's kernels compiled for
#      sm_80 / sm_89 / sm_90 (builder/compile_matrix.py), then the kernel tests under the
#      interpreter (tests/kernel_tests.txt);
#   2. the floor Triton (pyproject's triton>=X, the GPU machine's): the compile matrix again (it
#      binds the launches the first matrix recorded in .cache/compile-matrix/ under this Triton
#      instead of running the plugins' enumeration again: the same variants, ~220 s CPU less),
#      then the whole suite. The floor is installed beside the environment (.cache/triton-X, put first
#      on PYTHONPATH for this script and the processes it starts), so the environment is untouched.
#   bash tests/run.sh            # from the repository root, in the README's test environment
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
floor=$(python - <<'EOF'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(next(re.fullmatch(r"triton>=([\d.]+)", d.replace(" ", "")).group(1) for d in deps if d.startswith("triton")))
EOF
)
newest=$(python -c "import triton; print(triton.__version__)")
mapfile -t kernel_tests < <(grep -v -e '^#' -e '^$' tests/kernel_tests.txt)
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }

stamp "Triton $newest (newest): GPU compile matrix"
python -m infhip.builder.compile_matrix
stamp "Triton $newest (newest): kernel tests"
python -m pytest -q -ra -n 2 --dist loadfile -p no:cacheprovider "${kernel_tests[@]}"

floor_dir=.cache/triton-$floor
if [ "$(PYTHONPATH=$floor_dir python -c 'import triton; print(triton.__version__)' 2>/dev/null)" != "$floor" ]; then
  stamp "installing Triton $floor into $floor_dir"
  rm -rf "$floor_dir"
  python -m pip install -q --no-deps --target "$floor_dir" "triton==$floor"
fi
export PYTHONPATH=$PWD/$floor_dir${PYTHONPATH:+:$PYTHONPATH}
[ "$(python -c 'import triton; print(triton.__version__)')" = "$floor" ] || { echo "Triton $floor did not take"; exit 1; }
stamp "Triton $floor (floor): GPU compile matrix"
python -m infhip.builder.compile_matrix
stamp "Triton $floor (floor): the whole suite"
python -m pytest -q -ra -n 2 --dist loadfile
stamp done
