"""Helpers of the infhip-serve tests: a real uvicorn server on a free loopback port, raw HTTP
requests, SSE parsing, and the "engine is idle again" check."""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
import weakref

from infhip.runtime.server import make_server

_THREADS: "weakref.WeakKeyDictionary[object, threading.Thread]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def running_server(llm, **kwargs):
    """infhip-serve over llm on 127.0.0.1:<free port>, serving on a thread; stopped on exit."""
    server = make_server(llm, port=0, **kwargs)
    _THREADS[server] = server.start()
    try:
        yield server
    finally:
        server.shutdown()


def server_thread(server) -> threading.Thread:
    """The thread a running_server serves on (HttpServer.start's)."""
    return _THREADS[server]


def counter(metric, **labels) -> float:
    """A Prometheus counter's value now (labels: those of the child), read through its public
    collect()."""
    return next(s.value for m in metric.collect() for s in m.samples
                if s.name.endswith("_total") and s.labels == labels)


def request(server, method: str, path: str, body=None, timeout: float = 60) -> tuple[int, bytes]:
    """(status, body) of one request on a fresh connection; body: a dict (sent as JSON) or bytes."""
    conn = http.client.HTTPConnection(*server.server_address, timeout=timeout)
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.read()
    conn.close()
    return resp.status, out


def post(server, body, path: str = "/v1/completions") -> tuple[int, bytes]:
    return request(server, "POST", path, body)


def sse_events(data: bytes) -> list:
    """The JSON events of an SSE body that ends with [DONE]."""
    lines = [block[len(b"data: "):] for block in data.split(b"\n\n") if block.startswith(b"data: ")]
    assert lines and lines[-1] == b"[DONE]", data[-300:]
    return [json.loads(x) for x in lines[:-1]]


def error_of(data: bytes) -> dict:
    """The {"message", "type", "code"} of an error answer (and checks that shape)."""
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "code"} and err["message"], err
    return err


def kv_free_pages(core) -> dict[str, int]:
    return core.stats().kv_pages_free


def engine_is_idle(server, free_pages: dict[str, int]) -> bool:
    view = server.loop.core.debug_view()
    return (not server.loop.num_live and (view["requests"], view["running"], view["waiting"]) == ({}, [], [])
            and view["stats"]["kv_pages_free"] == free_pages)


def wait_for(condition, timeout_s: float) -> bool:
    """Whether condition() holds within timeout_s (looked at every 10 ms): for state the engine
    thread reaches on its own, with no event to wait on from here."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
