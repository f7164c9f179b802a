"""`infhip-serve`: an engine over HTTP (OpenAI-style completions), requests batched together.

    infhip-serve --engine engines/smollm2-135m --port 8000
    curl localhost:8000/v1/completions -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}'
    curl -N localhost:8000/v1/completions -d '{"prompt": "Once upon a time", "max_tokens": 32, "stream": true}'

Endpoints:

    POST /v1/completions   {"prompt": text or [token ids], "max_tokens", "temperature", "top_p",
                            "top_k", "stop", "stop_token_ids", "ignore_eos", "seed", "stream", "model"}
                           -> {"choices": [{"text", "token_ids", "finish_reason"}], "usage": {...}},
                           or with "stream": true server-sent events, one per delta, then [DONE]
    GET  /health           {"status": "ok"}
    GET  /v1/models        the one model this server runs

One engine thread owns the `LLM` and runs its steps (continuous batching); HTTP handler threads
hand it requests and read each request's deltas from a queue. A client that disconnects
mid-stream has its request aborted (its KV pages freed). Bad input gets 400 with
{"error": {"message": ...}} and never reaches the engine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import queue
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from infhip.runtime.sampling_params import SamplingParams

_SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos", "seed")
_KEYS = frozenset(_SAMPLING_KEYS + ("prompt", "stream", "model"))


class _Accepted:
    """First message of a request's queue: the engine took it (prompt length for the usage)."""

    def __init__(self, prompt_tokens: int):
        self.prompt_tokens = prompt_tokens


class EngineLoop:
    """The engine thread: takes requests from HTTP threads, steps the LLM, hands out deltas.

    Each request's queue receives `_Accepted`, then `StreamDelta`s (the last with its finish
    reason), then None; or one exception if the engine refused the request."""

    def __init__(self, llm):
        self.llm = llm
        self._inbox: queue.Queue = queue.Queue()
        self._live: dict[int, tuple[object, queue.Queue]] = {}  # id(outbox) -> (request, outbox)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="infhip-engine", daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join()

    def submit(self, prompt: str | None, token_ids: list[int] | None, params: SamplingParams) -> queue.Queue:
        outbox: queue.Queue = queue.Queue()
        self._inbox.put(("add", prompt, token_ids, params, outbox))
        return outbox

    def cancel(self, outbox: queue.Queue) -> None:
        self._inbox.put(("abort", outbox))

    def _handle(self, msg) -> None:
        if msg is None:
            return
        if msg[0] == "add":
            _, prompt, token_ids, params, outbox = msg
            try:
                req = self.llm._add(prompt, token_ids, params)
            except Exception as e:  # noqa: BLE001 - handed to the HTTP thread, which answers 400
                outbox.put(e)
                return
            self._live[id(outbox)] = (req, outbox)
            outbox.put(_Accepted(len(req.seq.prompt_token_ids)))
        else:
            live = self._live.pop(id(msg[1]), None)
            if live is not None:
                self.llm._abort(live[0])

    def _run(self) -> None:
        while not self._stop.is_set():
            try:  # wait for work when idle; otherwise take what arrived and step
                self._handle(self._inbox.get(timeout=None if not self._live else 0.0))
                while True:
                    self._handle(self._inbox.get_nowait())
            except queue.Empty:
                pass
            if not self._live or self._stop.is_set():
                continue
            try:
                touched = {id(r) for r in self.llm.step()}
            except Exception as e:  # noqa: BLE001 - every live request learns why and is freed
                for req, outbox in self._live.values():
                    self.llm._abort(req)
                    outbox.put(e)
                self._live.clear()
                continue
            for key, (req, outbox) in list(self._live.items()):
                if id(req) not in touched and not req.seq.is_finished:
                    continue  # nothing new (e.g. still prefilling): no detokenizer work
                delta = self.llm._delta(req)
                if delta is not None:
                    outbox.put(delta)
                if req.seq.is_finished:
                    self.llm._abort(req)  # forget it: its pages are already free
                    outbox.put(None)
                    del self._live[key]


class BadRequest(ValueError):
    pass


def parse_completion_request(body: bytes) -> tuple[str | None, list[int] | None, SamplingParams, bool]:
    """(prompt text, prompt token ids, sampling params, stream) of a /v1/completions body;
    BadRequest says what is wrong."""
    try:
        req = json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not JSON ({e})") from None
    if not isinstance(req, dict):
        raise BadRequest("the body must be a JSON object with at least \"prompt\"")
    unknown = sorted(set(req) - _KEYS)
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(unknown)}; accepted: {', '.join(sorted(_KEYS))}")
    prompt = req.get("prompt")
    if isinstance(prompt, str):
        text, ids = prompt, None
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        text, ids = None, prompt
    else:
        raise BadRequest("\"prompt\" must be a string or a non-empty list of token ids")
    stream = req.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("\"stream\" must be true or false")
    try:
        params = SamplingParams(**{k: req[k] for k in _SAMPLING_KEYS if k in req})
    except (TypeError, ValueError) as e:
        raise BadRequest(str(e)) from None
    return text, ids, params, stream


def make_server(llm, host: str = "127.0.0.1", port: int = 8000, model_name: str = "infhip") -> ThreadingHTTPServer:
    """An HTTP server (not yet serving: call serve_forever) over llm, with its engine thread
    started; server.loop is the EngineLoop; close with server.shutdown(), server.server_close()
    and server.loop.close()."""
    loop = EngineLoop(llm).start()
    ids = itertools.count()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet: one line per request on stderr is noise here
            pass

        def _json(self, status: int, obj) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str) -> None:
            self._json(status, {"error": {"message": message, "code": status}})

        def do_GET(self):  # noqa: N802 - http.server's naming
            if self.path == "/health":
                self._json(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": model_name, "object": "model"}]})
            else:
                self._error(404, f"no endpoint {self.path}; try POST /v1/completions, GET /health, GET /v1/models")

        def do_POST(self):  # noqa: N802
            if self.path != "/v1/completions":
                self._error(404, f"no endpoint {self.path}; try POST /v1/completions")
                return
            try:
                length = int(self.headers.get("Content-Length", 0))
                if length < 0:
                    raise BadRequest(f"Content-Length must be >= 0, got {length}")
                text, token_ids, params, stream = parse_completion_request(self.rfile.read(length))
            except (BadRequest, ValueError) as e:
                self._error(400, str(e))
                return
            outbox = loop.submit(text, token_ids, params)
            first = outbox.get()
            if isinstance(first, Exception):
                self._error(400 if isinstance(first, ValueError) else 500, str(first))
                return
            meta = {"id": f"cmpl-{next(ids)}", "created": int(time.time()), "model": model_name}
            if stream:
                self._stream(outbox, meta)
            else:
                self._complete(outbox, meta, first.prompt_tokens)

        def _complete(self, outbox, meta, prompt_tokens: int) -> None:
            pieces, tokens, reason = [], [], None
            while (delta := outbox.get()) is not None:
                if isinstance(delta, Exception):
                    self._error(500, f"the engine failed: {delta}")
                    return
                pieces.append(delta.text)
                tokens += delta.token_ids
                reason = delta.finish_reason or reason
            self._json(200, {**meta, "object": "text_completion",
                             "choices": [{"index": 0, "text": "".join(pieces), "token_ids": tokens,
                                          "finish_reason": reason}],
                             "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(tokens),
                                       "total_tokens": prompt_tokens + len(tokens)}})

        def _stream(self, outbox, meta) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")  # the body ends when the connection does
            self.end_headers()
            self.close_connection = True
            try:
                while (delta := outbox.get()) is not None:
                    if isinstance(delta, Exception):
                        event = {"error": {"message": f"the engine failed: {delta}", "code": 500}}
                    else:
                        event = {**meta, "object": "text_completion",
                                 "choices": [{"index": 0, "text": delta.text, "token_ids": delta.token_ids,
                                              "finish_reason": delta.finish_reason}]}
                    self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                    self.wfile.flush()
                    if isinstance(delta, Exception):
                        return
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):  # the client left: stop generating
                loop.cancel(outbox)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    server.loop = loop
    return server


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="infhip-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help="engine directory written by infhip-build")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (8000; 0 = any free one)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: the engine's target")
    p.add_argument("--kv-offload-gib", type=float, default=0.0,
                   help="pinned host memory for offloaded KV pages (InfiniteHiP engines; default 0: none)")
    args = p.parse_args(argv)
    from pathlib import Path

    from infhip.config import EngineFormatError
    from infhip.runtime.llm import LLM
    try:
        if args.kv_offload_gib < 0:
            raise ValueError(f"--kv-offload-gib must be >= 0, got {args.kv_offload_gib}")
        llm = LLM(args.engine, device=args.device, kv_offload_bytes=int(args.kv_offload_gib * (1 << 30)))
        server = make_server(llm, args.host, args.port, model_name=Path(args.engine).name)
    except (ValueError, EngineFormatError, MemoryError, OSError) as e:
        print(f"infhip-serve: error: {e}", file=sys.stderr)
        return 2
    host, port = server.server_address[:2]
    print(f"infhip-serve: {args.engine} on http://{host}:{port} (POST /v1/completions)", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        server.loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
