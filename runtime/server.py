"""`infhip-serve`: an engine over HTTP with an OpenAI-compatible API (FastAPI on uvicorn).

    infhip-serve --engine engines/smollm2-135m --port 8000
    curl localhost:8000/v1/completions -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}'
    curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}], "stream": true}'

Endpoints, flags, limits and metric names: docs/serving.md. One engine thread
(`EngineLoop`, runtime/engine_loop.py, also the Triton model's) owns the `EngineCore` and batches every
live request; the app (runtime/serving/) hands requests in and reads their deltas.

SIGTERM / SIGINT drain the server (runtime/serving/lifecycle.py): new requests get 503 and
/health/ready turns 503 at once, running requests get up to --drain-timeout to finish, the rest
are ended (a last "abort" event, or an error body), and the process exits 0. A second signal
ends them at once.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import threading

from infhip.runtime.engine_loop import EngineLoop

DEFAULT_BACKLOG = 2048  # pending connections the kernel queues (capped by net.core.somaxconn)


class HttpServer:
    """infhip-serve over an `LLM`: the socket is bound (and `server_address` known) at
    construction; `serve_forever()` serves on this thread until `shutdown()` (from another
    thread) or the drain that SIGINT/SIGTERM (on the main thread) or `drain()` starts, then stops
    the engine thread."""

    def __init__(self, llm, host: str = "127.0.0.1", port: int = 8000, model_name: str = "infhip",
                 limits=None, keep_alive_s: float = 5.0, backlog: int = DEFAULT_BACKLOG, policy=None,
                 access_log: bool | str = "all"):
        import uvicorn

        from infhip.runtime.serving.admission import WorkMeter
        from infhip.runtime.serving.app import HttpLimits, error_body, make_app
        from infhip.runtime.serving.async_engine import AsyncEngine
        from infhip.runtime.serving.header_timeout import header_timeout_protocol
        from infhip.runtime.serving.lifecycle import Gate, Lifecycle, ServingPolicy
        from infhip.runtime.serving.metrics import ServerMetrics

        access_log = _access_log_choice(access_log)  # before anything binds or starts
        # the engine thread: all the app reaches of the engine (runtime/engine_loop.py)
        self.loop = EngineLoop(llm)
        self.metrics = ServerMetrics(self.loop.info)
        self.loop.observer = self.metrics
        self.engine = AsyncEngine(self.loop.start())
        self.limits = limits or HttpLimits()
        self.policy = policy or ServingPolicy()
        self.lifecycle = Lifecycle(self.policy, self.loop.info, self.loop, self.metrics)
        self.metrics.meter = WorkMeter(self.lifecycle.throughput, self.loop)
        self.app = make_app(self.engine, self.metrics, model_name, self.limits, self.lifecycle)
        self._socket = _listen(host, port, backlog)
        self.server_address = self._socket.getsockname()[:2]
        self._thread: threading.Thread | None = None  # set by start()
        self._uvicorn = _uvicorn_server(self, uvicorn.Config(
            _with_access_log(Gate(self.app, self.lifecycle, error_body), access_log), log_level="warning", access_log=False, lifespan="off",
            backlog=backlog, timeout_keep_alive=keep_alive_s, timeout_graceful_shutdown=5,
            http=header_timeout_protocol(self.policy.header_timeout_s) if self.policy.header_timeout_s else "h11"))
        self._event_loop: asyncio.AbstractEventLoop | None = None  # the server's, once it runs
        self._drain_task: asyncio.Task | None = None

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
        """Stop now (tests): no drain; running streams are cut."""
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join()

    def drain(self) -> None:
        """What SIGTERM does, from any thread: the first call drains, a second ends everything now."""
        if self._event_loop is None:
            raise RuntimeError("the server is not serving yet: call drain() after start() / serve_forever()")
        self._event_loop.call_soon_threadsafe(self._on_signal, None)

    # -- drain (on the server's event loop) -----------------------------------------------------
    def _on_signal(self, signum: int | None) -> None:
        name = signal.Signals(signum).name if signum else "drain()"
        if self._drain_task is None:
            n = self.lifecycle.requests_in
            _say(f"{name}: draining {n} request(s) for up to {self.policy.drain_timeout_s:g} s "
                 "(new ones get 503; a second signal ends them now)")
            self._drain_task = asyncio.ensure_future(self._drain())
        elif not self.lifecycle.ending:
            _say(f"{name} again: ending {self.lifecycle.requests_in} request(s) now")
            asyncio.ensure_future(self.lifecycle.end_now())

    async def _drain(self) -> None:
        finished = await self.lifecycle.drain(self.policy.drain_timeout_s)
        if not finished:
            _say("drain timeout: the server ended the requests still running")
        self._uvicorn.should_exit = True  # uvicorn closes the listener and idle connections, then returns


def _access_log_choice(which: bool | str) -> str:
    """One of ACCESS_LOG_CHOICES (True / False: "all" / "off"); ValueError otherwise."""
    from infhip.runtime.serving.access_log import ACCESS_LOG_CHOICES

    which = ("all" if which else "off") if isinstance(which, bool) else which
    if which not in ACCESS_LOG_CHOICES:
        raise ValueError(f"access_log must be one of {', '.join(ACCESS_LOG_CHOICES)}, got {which!r}")
    return which


def _with_access_log(app, which: str):
    """app behind the access log layer (runtime/serving/access_log.py) for ``which`` of
    ACCESS_LOG_CHOICES: every request, the API's only (probes and scrapes left out), none."""
    from infhip.runtime.serving.access_log import AccessLog
    from infhip.runtime.serving.lifecycle import OPEN_PATHS

    if which == "off":
        return app
    return AccessLog(app, skip_paths=OPEN_PATHS if which == "requests" else frozenset())


def _say(message: str) -> None:
    print(f"infhip-serve: {message}", file=sys.stderr, flush=True)


def _uvicorn_server(owner: HttpServer, config):
    """A uvicorn.Server whose SIGINT/SIGTERM start owner's drain instead of uvicorn's own
    shutdown (which cuts running streams after timeout_graceful_shutdown and re-raises the signal
    at exit, so SIGTERM ended the process with status 143)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            owner._event_loop = asyncio.get_running_loop()
            await super().startup(sockets)

        def handle_exit(self, sig, frame):  # a signal handler, on the main thread (the loop's)
            if owner._event_loop is None:  # not serving yet
                self.should_exit = True
            else:
                owner._event_loop.call_soon_threadsafe(owner._on_signal, sig)
    return Server(config)


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose proto says
    # TCP, and without it each streamed event after the first waited for the client's delayed ACK
    # (~40 ms on Linux) on a keep-alive connection (found by infhip-bench serve's ITL)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
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
    from infhip.runtime.serving.lifecycle import ServingPolicy

    p = argparse.ArgumentParser(prog="infhip-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help="engine directory written by infhip-build")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the model name(s) requests may give in \"model\" (GET /v1/models lists them; another "
                        "name gets 404); default: the engine directory's name")
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
    d = ServingPolicy()
    life = p.add_argument_group("lifecycle (docs/serving.md, Lifecycle)")
    life.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s,
                      help=f"on SIGTERM/SIGINT, seconds running requests may go on (default {d.drain_timeout_s:g})")
    life.add_argument("--max-waiting-requests", type=int, default=None,
                      help="requests held beyond the engine's batch before 429 (default: no count limit; "
                           "--max-queue-wait decides)")
    life.add_argument("--max-waiting-tokens", type=int, default=None,
                      help="prompt tokens held beyond the KV cache's capacity before 429 "
                           "(default: 16M or that capacity, whichever is larger)")
    life.add_argument("--max-queue-wait", type=float, default=None,
                      help="past 256 requests in the server, 429 once the expected wait for the work in it "
                           "(tokens over the measured throughput) passes this many seconds (default: "
                           "--request-timeout if set, else 600)")
    life.add_argument("--request-timeout", type=float, default=d.request_timeout_s,
                      help="default and cap of a request's deadline in seconds, from its arrival (default 0 = none)")
    life.add_argument("--header-timeout", type=float, default=d.header_timeout_s,
                      help="seconds for a request line and headers to arrive, else 408 "
                           f"(default {d.header_timeout_s:g}; 0 = none)")
    life.add_argument("--stall-timeout", type=float, default=d.stall_timeout_s,
                      help=f"/health/live answers 503 once one engine step runs longer (default {d.stall_timeout_s:g})")
    life.add_argument("--api-key", default=os.environ.get("INFHIP_API_KEY"),
                      help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize "
                           "(default $INFHIP_API_KEY; unset = no key)")
    p.add_argument("--access-log", nargs="?", const="all", default="all", choices=("all", "requests", "off"),
                   help="one line per request on stderr (client, method, path, status, latency, tokens): for "
                        "all requests (default, as vLLM), only the API's (requests: probes and scrapes of "
                        "/health*, /metrics, /version left out) or none (off)")
    p.add_argument("--no-access-log", dest="access_log", action="store_const", const="off",
                   help="the same as --access-log off")
    add_load_options(p)  # LLM's options, same names (runtime/options.py)
    return p


def main(argv=None) -> int:
    from infhip.runtime.options import load_options
    from infhip.runtime.serving.app import HttpLimits

    args = make_parser().parse_args(argv)
    from pathlib import Path

    from infhip.config import EngineFormatError
    from infhip.runtime.llm import LLM
    from infhip.runtime.serving.admission import FLOOR
    from infhip.runtime.serving.lifecycle import ServingPolicy
    try:
        policy = ServingPolicy(drain_timeout_s=args.drain_timeout, max_waiting_requests=args.max_waiting_requests,
                               max_waiting_tokens=args.max_waiting_tokens, max_queue_wait_s=args.max_queue_wait,
                               request_timeout_s=args.request_timeout,
                               header_timeout_s=args.header_timeout, stall_timeout_s=args.stall_timeout,
                               api_key=args.api_key or None)
        for name in ("body_timeout", "keep_alive_timeout"):
            if getattr(args, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
        for name in ("max_body_bytes", "backlog"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        llm = LLM(args.engine, load_options(args))
        server = make_server(llm, args.host, args.port, model_name=args.served_model_name or Path(args.engine).name,
                             limits=HttpLimits(args.max_body_bytes, args.body_timeout),
                             keep_alive_s=args.keep_alive_timeout, backlog=args.backlog, policy=policy,
                             access_log=args.access_log)
    except (ValueError, EngineFormatError, MemoryError, OSError) as e:
        print(f"infhip-serve: error: {e}", file=sys.stderr)
        return 2
    lc = server.lifecycle
    if args.access_log != "off":
        _print_access_log()
    count = (f"up to {lc.max_requests} requests" if lc.max_requests is not None else
             f"any number of requests while the work in it is under {lc.max_queue_wait_s:g} s (always {FLOOR})")
    print(f"infhip-serve: {args.engine} on {server.url} (POST /v1/completions, /v1/chat/completions; "
          f"GET /v1/models, /health, /metrics); admits {count} and {lc.max_prompt_tokens} prompt tokens"
          f"{_tokenizer_hint(args.engine)}", file=sys.stderr, flush=True)
    server.serve_forever()
    _say("stopped")
    return 0


def _tokenizer_hint(engine: str) -> str:
    """The tokenizer folder that load-test clients (guidellm, aiperf, vllm bench serve) need as
    --tokenizer: the engine's tokenizer/ (the engine folder itself is not a model folder)."""
    from pathlib import Path

    folder = Path(engine).resolve() / "tokenizer"
    return f"; tokenizer for clients: {folder}" if folder.is_dir() else "; no tokenizer (token-id prompts only)"


def _print_access_log() -> None:
    """The access log's lines on stderr, each whole (logging writes a record in one call)."""
    import logging

    from infhip.runtime.serving.access_log import LOGGER
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("infhip-serve: %(message)s"))
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False


if __name__ == "__main__":
    sys.exit(main())
