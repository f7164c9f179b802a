"""The dry run's stand-in for `vllm bench serve` (bench_vs_vllm.py --dry-run, CPU): infhip-serve on a
tiny engine, sent the request body vLLM 0.20.0's `openai` backend sends
(vllm/benchmarks/lib/endpoint_request_func.py, async_request_openai_completions, with
--ignore-eos --temperature 0), its stream read the way that function reads it: SSE `data:` lines,
the first chunk with `choices` is the first token, `usage.completion_tokens` the output count. A
field infhip-serve refused, or a stream vLLM's client could not read, fails here before any GPU
time is spent.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path


def vllm_payload(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": max_tokens,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, "temperature": 0.0}


def one(url: str, payload: dict) -> dict:
    import httpx
    st = time.perf_counter()
    ttft, last, itl, text, out_tokens = None, st, [], "", None
    with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"infhip-serve answered {r.status_code}: {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if not line or line.startswith(":"):
                continue
            chunk = line.removeprefix("data: ")
            if chunk == "[DONE]":
                continue
            data = json.loads(chunk)
            if choices := data.get("choices"):
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - st
                else:
                    itl.append(now - last)
                last = now
                text += choices[0].get("text") or ""
            elif usage := data.get("usage"):
                out_tokens = usage.get("completion_tokens")
    if ttft is None or out_tokens != payload["max_tokens"]:
        raise RuntimeError(f"vLLM's client would fail here: ttft {ttft}, completion_tokens {out_tokens}")
    e2e = time.perf_counter() - st
    return {"ttft": ttft, "tpot": (e2e - ttft) / max(1, out_tokens - 1), "words": len(text.split())}


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list[str], port: int, log: Path, ready_s: float) -> subprocess.Popen:
    """Start a server in its own session; return once GET /v1/models answers on `port`."""
    import urllib.request
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + ready_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:4]} exited with {proc.returncode}; log: {log}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
            return proc
        except OSError:
            time.sleep(1)
    stop_server(proc)
    raise RuntimeError(f"{cmd[:4]} not ready after {ready_s:.0f} s; log: {log}")


def stop_server(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def dry_run_serving(cmd: list[str], out: Path, name: str, port: int) -> dict:
    """A few requests of two shapes through infhip-serve (`cmd`) with vLLM's body; TTFT / TPOT medians."""
    proc = start_server(cmd, port, out / "server_infhip_dry.log", ready_s=300)
    url = f"http://127.0.0.1:{port}"
    res = {}
    try:
        for row, prompt_len, max_tokens in (("random_short", 64, 8), ("random_long", 1024, 4)):
            prompt = " ".join(f"t{(7 * i) % 500 + 10}" for i in range(prompt_len))
            runs = [one(url, vllm_payload(name, prompt, max_tokens)) for _ in range(3)]
            res[f"infhip/{row}"] = {"median_ttft_ms": 1e3 * statistics.median(r["ttft"] for r in runs),
                                    "median_tpot_ms": 1e3 * statistics.median(r["tpot"] for r in runs)}
            print(f"[bench_vs_vllm] dry-run serve {row}: {res[f'infhip/{row}']}", flush=True)
    finally:
        stop_server(proc)
    return res
