"""The request-path trace of docs/design/request_path.md: which of the repository's source files
run while `infhip-serve` answers one streaming ``/v1/chat/completions`` request on a dense engine.

    python tests/request_path_trace.py        # the count, then the files, one a line

A trace function on every thread (``threading.settrace`` and ``sys.settrace``, installed before
the engine loads) records the file of each Python call under the repository while the server
answers a second request (the first warms lazy imports and first-step paths; ``max_tokens`` 8,
``"stream": true``) on the tests' tiny Llama (a float32 CPU engine with a tokenizer). Loading,
building and the tests' own files are not counted. tests/test_request_path.py runs it.
"""

from __future__ import annotations

import http.client
import json
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def trace() -> list[str]:
    """The repository-relative paths of the files the second request ran, sorted."""
    files, recording, root = set(), [False], str(ROOT) + "/"

    def tracer(frame, event, arg):
        if recording[0] and event == "call":
            f = frame.f_code.co_filename
            if f.startswith(root) and not f.startswith((root + "tests/", root + ".venv/", root + ".cache/")):
                files.add(f[len(root):])

    threading.settrace(tracer)
    sys.settrace(tracer)
    from infhip import LLM
    from infhip.runtime.server import make_server
    from tests._tiny import build_tiny_api_engine

    server = make_server(LLM(build_tiny_api_engine(Path(tempfile.mkdtemp()))), port=0)
    server.start()
    body = {"model": "infhip", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8,
            "stream": True}

    def request() -> None:
        conn = http.client.HTTPConnection(*server.server_address, timeout=60)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        assert conn.getresponse().read().rstrip().endswith(b"[DONE]")

    try:
        request()
        recording[0] = True
        request()
        recording[0] = False
    finally:
        sys.settrace(None)
        threading.settrace(None)
        server.shutdown()
    return sorted(files)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # tests._tiny
    found = trace()
    print(len(found), *found, sep="\n")
