"""Serve an engine from a Triton Inference Server model repository and ask it once.

Exports the engine (`infhip-export-triton`), starts the tritonserver that `nvidia-pytriton`
bundles (CPU is enough for a small engine) on --host (loopback by default), then asks
``/v2/models/<m>/generate`` and ``/generate_stream`` and prints the answers. With --keep it
keeps serving until SIGINT (Ctrl-C) or SIGTERM. Either signal drains: tritonserver refuses new
requests (UNAVAILABLE), running ones get --drain-timeout seconds, then the launcher ends the rest
(a last "abort" response; runtime/serving/triton/launch.py), tritonserver unloads the model and ends its
Python-backend stub; the launcher removes the temporary backend folder and exits 0. A second
signal ends the running requests at once (the same way).

    pip install -e ".[triton-server]"        # nvidia-pytriton, numpy < 2, tritonclient (docs/serving_triton.md)
    python examples/triton_serve.py --engine engines/smollm2-135m --repo /tmp/triton_repo --prompt "The capital of France is"

In a Triton container, skip the launcher: ``tritonserver --model-repository /tmp/triton_repo``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import urllib.request

from infhip.runtime.serving.triton.export import export_triton_repo
from infhip.runtime.serving.triton.launch import numpy_ok, running_server


class Terminated(Exception):
    """SIGINT or SIGTERM arrived: leave the server's `with` block, which stops it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


END_NOW = threading.Event()  # a second signal: end the running requests without waiting out the drain


def _on_signal(signum: int, frame) -> None:
    _on_stopping()
    raise Terminated(signum)


def _on_stopping() -> None:
    """From here on the server is being stopped: a signal only cuts the drain short."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: END_NOW.set())


def post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return resp.read()


def ask(base: str, name: str, prompt: str, max_tokens: int) -> None:
    """One whole answer, then the same request streamed."""
    body = {"text_input": prompt, "max_tokens": max_tokens, "temperature": 0}
    print(f"\nPOST {base}/v2/models/{name}/generate {json.dumps(body)}")
    print(post(f"{base}/v2/models/{name}/generate", body).decode())
    body["stream"] = True
    print(f"\nPOST {base}/v2/models/{name}/generate_stream {json.dumps(body)}")
    for event in post(f"{base}/v2/models/{name}/generate_stream", body).split(b"\n\n"):
        if event.startswith(b"data: "):
            print(event.decode())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help="engine directory written by infhip-build")
    p.add_argument("--repo", default="triton_repo", help="model repository to write (replaced if it holds the model)")
    p.add_argument("--model-name", default=None, help="default: the engine folder's name")
    p.add_argument("--host", default="127.0.0.1",
                   help="address tritonserver binds (HTTP, gRPC, metrics); 0.0.0.0 serves every interface")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (gRPC and metrics: the next two)")
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--keep", action="store_true", help="keep serving after the demo requests (Ctrl-C stops)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds running requests may go on before they are ended (default 30)")
    args = p.parse_args()
    if not numpy_ok():
        print("warning: numpy >= 2 here; the bundled Python-backend stub crashes on string inputs with it "
              "(docs/serving_triton.md)", file=sys.stderr)

    name = export_triton_repo(args.engine, args.repo, model_name=args.model_name, force=True).name
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)
    try:
        with running_server(args.repo, args.host, args.port, args.port + 1, args.port + 2,
                            drain_timeout_s=args.drain_timeout, end_now=END_NOW) as server:
            try:
                print(f"tritonserver (pid {server.proc.pid}): HTTP {server.url}, gRPC {server.grpc_url}, "
                      f"metrics {server.metrics_url}", flush=True)
                ask(server.url, name, args.prompt, args.max_tokens)
                if args.keep:
                    print(f"\nserving {name} on {server.url} (Ctrl-C stops)", flush=True)
                    status = server.proc.wait()  # returns only if tritonserver ends by itself
                    print(f"tritonserver exited with status {status}", file=sys.stderr)
                    return 1
            finally:
                _on_stopping()
    except Terminated as t:
        print(f"{t}: tritonserver drained and stopped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
