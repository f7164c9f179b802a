"""`infhip-serve`: an engine over HTTP with an OpenAI-compatible API (FastAPI on uvicorn).

    infhip-serve --engine engines/smollm2-135m --port 8000
    curl localhost:8000/v1/completions -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}'
    curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}], "stream": true}'

Endpoints, flags, limits and metric names: docs/serving.md. One engine thread
(`EngineLoop`, runtime/engine_loop.py, also the Triton model's) owns the `LLM` and batches every
live request; the app (runtime/serving/) hands requests in and reads their deltas.
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading

from infhip.runtime.engine_loop import EngineLoop, _Accepted  # noqa: F401 - the Triton model imports them from here

DEFAULT_BACKLOG = 2048  # pending connections the kernel queues (capped by net.core.somaxconn)


class HttpServer:
    """infhip-serve over an `LLM`: the socket is bound (and `server_address` known) at
    construction; `serve_forever()` serves on this thread until `shutdown()` (from another
    thread) or SIGINT/SIGTERM (on the main thread), then stops the engine thread."""

    def __init__(self, llm, host: str = "127.0.0.1", port: int = 8000, model_name: str = "infhip",
                 limits=None, keep_alive_s: float = 5.0, backlog: int = DEFAULT_BACKLOG):
        import uvicorn

        from infhip.runtime.serving.app import HttpLimits, make_app
        from infhip.runtime.serving.async_engine import AsyncEngine
        from infhip.runtime.serving.metrics import ServerMetrics

        self.metrics = ServerMetrics(llm)
        self.engine = AsyncEngine(llm, self.metrics)
        self.loop: EngineLoop = self.engine.loop
        self.limits = limits or HttpLimits()
        self.app = make_app(self.engine, self.metrics, model_name, self.limits)
        self._socket = _listen(host, port, backlog)
        self.server_address = self._socket.getsockname()[:2]
        self._thread: threading.Thread | None = None  # set by start()
        self._uvicorn = uvicorn.Server(uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan="off", backlog=backlog,
            timeout_keep_alive=keep_alive_s, timeout_graceful_shutdown=5))

    @property
    def url(self) -> str:
        host, port = self.server_address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def serve_forever(self) -> None:
        try:
            self._uvicorn.run(sockets=[self._socket])
        finally:
            self.engine.close()
            self._socket.close()

    def start(self) -> threading.Thread:
        """Serve on a daemon thread (tests, benchmarks); stop with shutdown()."""
        self._thread = threading.Thread(target=self.serve_forever, name="infhip-http", daemon=True)
        self._thread.start()
        return self._thread

    def shutdown(self) -> None:
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join()


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def make_server(llm, host: str = "127.0.0.1", port: int = 8000, model_name: str = "infhip", **kwargs) -> HttpServer:
    return HttpServer(llm, host, port, model_name, **kwargs)


def make_parser():
    from infhip.runtime.options import add_load_options
    from infhip.runtime.serving.app import HttpLimits

    p = argparse.ArgumentParser(prog="infhip-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help="engine directory written by infhip-build")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1; 0.0.0.0 = every interface)")
    p.add_argument("--port", type=int, default=8000, help="port (8000; 0 = any free one)")
    p.add_argument("--max-body-bytes", type=int, default=HttpLimits.max_body_bytes,
                   help=f"largest request body; larger ones get 413 (default {HttpLimits.max_body_bytes})")
    p.add_argument("--body-timeout", type=float, default=HttpLimits.body_timeout_s,
                   help=f"seconds for a request body to arrive, else 408 (default {HttpLimits.body_timeout_s:g})")
    p.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open (default 5)")
    p.add_argument("--backlog", type=int, default=DEFAULT_BACKLOG,
                   help=f"connections the kernel queues before accepting (default {DEFAULT_BACKLOG})")
    add_load_options(p)  # LLM's options, same names (runtime/options.py)
    return p


def main(argv=None) -> int:
    from infhip.runtime.options import load_options
    from infhip.runtime.serving.app import HttpLimits

    args = make_parser().parse_args(argv)
    from pathlib import Path

    from infhip.config import EngineFormatError
    from infhip.runtime.llm import LLM
    try:
        for name in ("body_timeout", "keep_alive_timeout"):
            if getattr(args, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
        for name in ("max_body_bytes", "backlog"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        llm = LLM(args.engine, load_options(args))
        server = make_server(llm, args.host, args.port, model_name=Path(args.engine).name,
                             limits=HttpLimits(args.max_body_bytes, args.body_timeout),
                             keep_alive_s=args.keep_alive_timeout, backlog=args.backlog)
    except (ValueError, EngineFormatError, MemoryError, OSError) as e:
        print(f"infhip-serve: error: {e}", file=sys.stderr)
        return 2
    print(f"infhip-serve: {args.engine} on {server.url} (POST /v1/completions, /v1/chat/completions; "
          "GET /v1/models, /health, /metrics)", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT after its graceful shutdown
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
