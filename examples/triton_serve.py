"""Serve an engine from a Triton Inference Server model repository and ask it once.

Exports the engine (`infhip-export-triton`), starts the tritonserver that `nvidia-pytriton`
bundles (CPU is enough for a small engine), then asks ``/v2/models/<m>/generate`` and
``/generate_stream`` and prints the answers. With --keep it keeps serving until Ctrl-C.

    pip install --no-deps nvidia-pytriton==0.7.0        # in an environment with numpy < 2 (docs/serving.md)
    python examples/triton_serve.py --engine engines/smollm2-135m --repo /tmp/triton_repo --prompt "The capital of France is"

In a Triton container, skip the launcher: ``tritonserver --model-repository /tmp/triton_repo``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from infhip.builder.export_triton import export_triton_repo
from infhip.builder.triton_launch import numpy_ok, server_command, stop_server


def post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return resp.read()


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"tritonserver exited with status {proc.returncode}; see its log above")
        try:
            with urllib.request.urlopen(f"{base}/v2/health/ready", timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    raise SystemExit(f"tritonserver was not ready after {timeout:.0f} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help="engine directory written by infhip-build")
    p.add_argument("--repo", default="triton_repo", help="model repository to write (replaced if it holds the model)")
    p.add_argument("--model-name", default=None, help="default: the engine folder's name")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (gRPC and metrics: the next two)")
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--keep", action="store_true", help="keep serving after the demo requests (Ctrl-C stops)")
    args = p.parse_args()
    if not numpy_ok():
        print("warning: numpy >= 2 here; the bundled Python-backend stub crashes on string inputs with it "
              "(docs/serving.md)", file=sys.stderr)

    model_dir = export_triton_repo(args.engine, args.repo, model_name=args.model_name, force=True)
    name = model_dir.name
    argv, env = server_command(args.repo, Path(args.repo).resolve().parent / ".triton_backends",
                               args.port, args.port + 1, args.port + 2)
    print("$", " ".join(argv), flush=True)
    proc = subprocess.Popen(argv, env=env)
    base = f"http://127.0.0.1:{args.port}"
    try:
        wait_ready(base, proc)
        body = {"text_input": args.prompt, "max_tokens": args.max_tokens, "temperature": 0}
        print(f"\nPOST {base}/v2/models/{name}/generate {json.dumps(body)}")
        print(post(f"{base}/v2/models/{name}/generate", body).decode())
        print(f"\nPOST {base}/v2/models/{name}/generate_stream {json.dumps({**body, 'stream': True})}")
        for line in post(f"{base}/v2/models/{name}/generate_stream", {**body, "stream": True}).split(b"\n\n"):
            if line.startswith(b"data: "):
                print(line.decode())
        if args.keep:
            print(f"\nserving {name} on {base} (Ctrl-C stops)", flush=True)
            proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        stop_server(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
