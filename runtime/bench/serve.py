"""`infhip-bench serve`: fixed concurrencies against any OpenAI-compatible server (infhip-serve,
vLLM, SGLang, TensorRT-LLM's trtllm-serve), measured as `vllm bench serve --max-concurrency N`
measures: N clients, each sending its next streaming request when its last one ends, until all
are sent. Rate sweeps, datasets and reports are guidellm's and aiperf's (docs/serving.md).

Requests go to POST /v1/completions with ``stream: true``, ``ignore_eos: true`` (vLLM's
extension; every request then generates max_tokens) and ``stream_options.include_usage`` (the
token counts come from the server's usage; a server that sends none is counted per event).
Prompts are token-id lists (exact lengths, no tokenizer; OpenAI's completions API takes them)
unless text prompts are given. The client is the standard library's http.client, one
connection per client thread.
"""

from __future__ import annotations

import http.client
import json
import queue
import socket
import threading
import time
from urllib.parse import urlsplit

from infhip.runtime.bench.stats import summary


class _Connection(http.client.HTTPConnection):
    """http.client sends a request's headers and body in two writes: with Nagle's algorithm on,
    the body waits for the server's delayed ACK (~40 ms on Linux), which TTFT would count."""

    def connect(self):
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _post_stream(conn: http.client.HTTPConnection, path: str, body: dict, headers: dict):
    """Send one streaming request; yield (arrival time, event dict) per SSE data event."""
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **headers})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}")
    while True:
        line = resp.readline()
        if not line:
            return
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            resp.read()  # the chunked body's end: the connection is reusable
            return
        yield time.perf_counter(), json.loads(data)


def one_request(conn, path: str, model: str | None, prompt, max_tokens: int, headers: dict) -> dict:
    """One streaming completion: TTFT, ITLs, end-to-end time, token counts (or its error)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    sent = time.perf_counter()
    times, usage, events = [], None, 0
    try:
        for t, event in _post_stream(conn, path, body, headers):
            if event.get("usage"):
                usage = event["usage"]
            choices = event.get("choices") or []
            if choices and (choices[0].get("text") or choices[0].get("token_ids")):
                times.append(t)
                events += 1
    except (OSError, http.client.HTTPException, RuntimeError, ValueError) as e:
        conn.close()
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    if not times:
        return {"ok": False, "error": "no token came back"}
    out = usage["completion_tokens"] if usage else events
    return {"ok": True, "ttft": times[0] - sent, "e2e": times[-1] - sent, "itl": [b - a for a, b in zip(times, times[1:])],
            "output_tokens": out, "input_tokens": usage["prompt_tokens"] if usage else len(prompt)
            if isinstance(prompt, list) else None}


def run_concurrency(url: str, prompts: list, max_tokens: int, concurrency: int, model: str | None = None,
                    api_key: str | None = None, progress: bool = True) -> dict:
    """All prompts with at most `concurrency` in flight; vLLM's result fields (stats.SERVE_ROWS)."""
    from tqdm import tqdm

    parts = urlsplit(url if "://" in url else f"http://{url}")
    base = parts.path.rstrip("/")
    path = f"{base}/completions" if base.endswith("/v1") else f"{base}/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    todo: queue.Queue = queue.Queue()
    for p in prompts:
        todo.put(p)
    results, lock = [], threading.Lock()
    bar = tqdm(total=len(prompts), desc=f"serve c={concurrency}", unit="req", disable=not progress)

    def client():
        conn = _Connection(parts.hostname, parts.port or 80, timeout=3600)
        while True:
            try:
                prompt = todo.get_nowait()
            except queue.Empty:
                break
            r = one_request(conn, path, model, prompt, max_tokens, headers)
            if not r["ok"]:
                conn = _Connection(parts.hostname, parts.port or 80, timeout=3600)
            with lock:
                results.append(r)
                bar.update(1)
        conn.close()

    start = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(min(concurrency, len(prompts)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    duration = time.perf_counter() - start
    bar.close()
    return result_of(results, duration, concurrency)


def result_of(results: list[dict], duration: float, concurrency: int) -> dict:
    ok = [r for r in results if r["ok"]]
    n_in = sum(r["input_tokens"] or 0 for r in ok)
    n_out = sum(r["output_tokens"] for r in ok)
    tpot = [(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    out = {"completed": len(ok), "failed": len(results) - len(ok), "max_concurrency": concurrency,
           "duration": duration, "total_input_tokens": n_in, "total_output_tokens": n_out,
           "request_throughput": len(ok) / duration, "output_throughput": n_out / duration,
           "total_token_throughput": (n_in + n_out) / duration,
           "errors": sorted({r["error"] for r in results if not r["ok"]})[:5]}
    for name, values in (("ttft", [r["ttft"] for r in ok]), ("tpot", tpot), ("itl", [x for r in ok for x in r["itl"]]),
                         ("e2el", [r["e2e"] for r in ok])):  # e2el: vLLM's too, not in its default block
        s = summary(values, 1000)
        out.update({f"mean_{name}_ms": s["mean"], f"median_{name}_ms": s["median"], f"p99_{name}_ms": s["p99"]})
    return out
