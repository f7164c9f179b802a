#!/usr/bin/env bash
# Stage into .whl/serve (git-ignored; ~11 MiB, carried by the GPU calls that need it) the Python
# packages the GPU machine's image lacks (benchmarks/gpu/stage/machine_packages.txt) for the HTTP
# server, structured output and the server tests' openai client. Versions: what CI resolved on
# 2026-12-07 (pydantic pins its core; openai 3.x needs httpx2, fastapi needs opentelemetry-api).
# The calls install them with: pip install --no-index --no-deps --target /tmp/site .whl/serve/*.whl
#   bash benchmarks/gpu/stage/serving_wheels.sh        (here, repo root, before the GPU calls)
set -euo pipefail
cd "$(dirname "$0")/../../.."
grep -q '^/.whl/' .git/info/exclude 2>/dev/null || grep -q '^\.whl/' .gitignore || echo /.whl/ >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl/serve \
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 uvicorn==0.55.0 \
  xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 typing-inspection==0.4.5 annotated-types==0.8.0 \
  annotated-doc==0.0.7 opentelemetry-api==1.45.3 typing-extensions==4.16.0 anyio==4.16.0 \
  openai==3.63.0 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1
ls .whl/serve | wc -l; du -sh .whl/serve
