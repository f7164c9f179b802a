"""Drain with real processes and real signals (tiny engine batching 32, every step slowed by
tests/_slowed_cli.py so requests are still generating when the signal comes):

- SIGTERM during 32 concurrent streams: all 32 finish with their full answer, a request arriving
  during the drain gets 503 with Retry-After, /health/ready is 503 and /health/live 200 meanwhile,
  and infhip-serve exits 0;
- a short --drain-timeout: every stream ends with a last chunk whose finish_reason is "abort" and
  [DONE] (every event whole JSON, the tokens a prefix of the full answer), non-streaming requests
  get a 503 error body, exit 0;
- a second signal ends everything at once, streams closed the same way, exit 0;
- infhip-run: SIGTERM stops the completion after --drain-timeout with finish_reason "abort", exit 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from infhip import LLM, SamplingParams
from tests._serving import sse_events
from tests._tiny import API_ENGINE

SLOWED = str(Path(__file__).with_name("_slowed_cli.py"))
WORDS = "In the beginning God created the heaven and the earth and the earth was without form".split()
PROMPTS = [" ".join(WORDS[: 1 + i % len(WORDS)]) + f" {i}" for i in range(32)]
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine(**{**API_ENGINE, "max_batch_size": 32})


@pytest.fixture(scope="module")
def reference(engine):
    """max_tokens -> {prompt: token ids} generated offline."""
    llm, cache = LLM(engine), {}

    def get(max_tokens: int) -> dict[str, list[int]]:
        if max_tokens not in cache:
            outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, **GREEDY))
            cache[max_tokens] = {p: o.token_ids for p, o in zip(PROMPTS, outs)}
        return cache[max_tokens]
    get.llm = llm
    return get


class Served:
    """infhip-serve in a subprocess (steps slowed), its URL, and its stderr lines so far."""

    def __init__(self, engine: Path, delay_s: float, *flags: str):
        self.proc = subprocess.Popen([sys.executable, SLOWED, str(delay_s), "infhip.runtime.server", "--engine",
                                      str(engine), "--port", "0", *flags],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        for line in self.proc.stderr:
            self.lines.append(line)
            if " on http://" in line:
                self.url = line.split(" on ")[1].split()[0]
                break
        else:
            raise AssertionError(f"infhip-serve did not start: {''.join(self.lines)[-2000:]}")
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self._reader.start()

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def exit_status(self, timeout_s: float) -> int:
        try:
            status = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {timeout_s} s on; its stderr:\n{self.log}") from None
        self._reader.join(5)
        return status

    @property
    def log(self) -> str:
        return "".join(self.lines)[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


async def run_clients(served: Served, bodies: list[dict], during_drain, signals: list[tuple[float, int]]):
    """Send every body at once; once each streaming one has its first event, send `signals`
    ((delay before it, signal) each), then await during_drain(client); return ([(status, body)]
    in order, what during_drain returned)."""
    first = asyncio.Event()
    started = 0
    streaming = sum(b.get("stream", False) for b in bodies)

    async def one(client, body):
        nonlocal started
        data, counted = b"", not body.get("stream")
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for chunk in r.aiter_bytes():
                    data += chunk
                    if not counted and b"data: " in data:
                        counted, started = True, started + 1
                        if started == streaming:
                            first.set()
                return r.status_code, data
        except httpx.HTTPError as e:  # cut: the checks below fail on it with the server's log
            return -1, data + f"\n\n(the connection broke: {e!r})".encode()

    limits = httpx.Limits(max_connections=len(bodies) + 8)
    async with httpx.AsyncClient(base_url=served.url, timeout=120, limits=limits) as client:
        tasks = [asyncio.create_task(one(client, b)) for b in bodies]
        await asyncio.wait_for(first.wait(), 120)
        for delay, sig in signals:
            await asyncio.sleep(delay)
            served.signal(sig)
        seen = await during_drain(client)
        return await asyncio.gather(*tasks), seen


async def probe_drain(client: httpx.AsyncClient):
    """A request, /health/ready and /health/live once the drain has begun."""
    for _ in range(100):
        ready = await client.get("/health/ready")
        if ready.status_code == 503:
            break
        await asyncio.sleep(0.02)
    late = await client.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
    live = await client.get("/health/live")
    return ready, late, live


def events_of(data: bytes, served: Served) -> list[dict]:
    """sse_events, failing with the server's log."""
    try:
        return sse_events(data)
    except (AssertionError, ValueError) as e:
        raise AssertionError(f"{e}\n--- infhip-serve's stderr:\n{served.log}") from None


def stream_ids(events: list[dict]) -> list[int]:
    return [t for e in events for t in e["choices"][0]["token_ids"]]


def test_sigterm_lets_32_streams_finish_then_exits_0(engine, reference):
    want = reference(24)
    served = Served(engine, 0.05, "--drain-timeout", "60")
    try:
        bodies = [{"prompt": p, "max_tokens": 24, "stream": True, **GREEDY} for p in PROMPTS]
        answers, (ready, late, live) = asyncio.run(
            run_clients(served, bodies, probe_drain, [(0, signal.SIGTERM)]))
        signalled = time.monotonic()
        assert ready.status_code == 503 and "draining" in ready.json()["error"]["message"]
        assert late.status_code == 503 and late.headers["retry-after"] == "1"
        assert late.json()["error"]["code"] == 503 and live.status_code == 200
        for prompt, (status, data) in zip(PROMPTS, answers):
            events = events_of(data, served)
            assert status == 200 and events[-1]["choices"][0]["finish_reason"] == "length"
            assert stream_ids(events) == want[prompt], prompt
        assert served.exit_status(30) == 0, served.log
        assert time.monotonic() - signalled < 15, (time.monotonic() - signalled, served.log)
        log = "".join(served.lines)
        assert "SIGTERM: draining 32 request(s)" in log and "drain timeout" not in log
        # the access log, on by default: one line per stream (24 tokens each) and the 503 in the drain
        streams = [ln for ln in served.lines if '"POST /v1/completions HTTP/1.1" 200 ' in ln]
        assert len(streams) == 32 and all(ln.rstrip().endswith("completion_tokens=24") for ln in streams), log
        assert any('"POST /v1/completions HTTP/1.1" 503 ' in ln for ln in served.lines), log
    finally:
        served.stop()


async def nothing(client):
    return None


def prefix_ok(ids: list[int], want: list[int]) -> bool:
    """ids (cut short) agree with the full answer as far as both go (want: its first tokens)."""
    n = min(len(ids), len(want))
    return ids[:n] == want[:n]


def test_short_drain_timeout_ends_streams_with_abort(engine, reference):
    want = reference(24)  # the first 24 tokens of each answer (greedy: a longer run starts the same)
    served = Served(engine, 0.05, "--drain-timeout", "0.5")
    try:
        bodies = [{"prompt": p, "max_tokens": 100, "stream": i >= 2, **GREEDY} for i, p in enumerate(PROMPTS)]
        answers, _ = asyncio.run(run_clients(served, bodies, nothing, [(0, signal.SIGTERM)]))
        signalled = time.monotonic()
        for i, (prompt, (status, data)) in enumerate(zip(PROMPTS, answers)):
            if i < 2:  # not streaming: an error body
                err = json.loads(data)["error"]
                assert status == 503 and "shutting down" in err["message"], data
                continue
            events = events_of(data, served)  # whole JSON events, then [DONE]
            ids = stream_ids(events)
            assert events[-1]["choices"][0]["finish_reason"] == "abort", prompt
            assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
            assert 0 < len(ids) < 100 and prefix_ok(ids, want[prompt]), prompt
        assert served.exit_status(30) == 0, served.log
        assert time.monotonic() - signalled < 15, (time.monotonic() - signalled, served.log)
        assert "drain timeout: the server ended the requests still running" in "".join(served.lines)
    finally:
        served.stop()


def test_second_signal_ends_everything_at_once(engine, reference):
    want = reference(24)
    served = Served(engine, 0.05, "--drain-timeout", "120")
    try:
        bodies = [{"prompt": p, "max_tokens": 100, "stream": True, **GREEDY} for p in PROMPTS[:8]]
        answers, _ = asyncio.run(run_clients(served, bodies, nothing, [(0, signal.SIGTERM), (0.3, signal.SIGINT)]))
        second = time.monotonic()
        for prompt, (status, data) in zip(PROMPTS, answers):
            events = events_of(data, served)
            ids = stream_ids(events)
            assert events[-1]["choices"][0]["finish_reason"] == "abort" and prefix_ok(ids, want[prompt]), served.log
        assert served.exit_status(30) == 0, served.log
        assert time.monotonic() - second < 15, (time.monotonic() - second, served.log)
        assert "SIGINT again: ending 8 request(s) now" in "".join(served.lines)
    finally:
        served.stop()


def test_infhip_run_drains_then_exits_0(engine, reference):
    sig = signal.SIGTERM
    full = reference.llm.generate(["abc"], SamplingParams(max_tokens=30, **GREEDY))[0]
    proc = subprocess.Popen([sys.executable, SLOWED, "0.1", "infhip.runtime.cli", "--engine", str(engine),
                             "--prompt", "abc", "--max-tokens", "100", "--temperature", "0", "--ignore-eos",
                             "--drain-timeout", "0.4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = os.read(proc.stdout.fileno(), 1)  # it is generating (unbuffered: communicate reads the fd)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = (first + out).decode()
    assert proc.returncode == 0, err.decode()[-2000:]
    line = [x for x in err.decode().splitlines() if "stopped after" in x]
    assert line and line[0].startswith(f"[infhip-run] {signal.Signals(sig).name}: stopped after")
    assert line[0].endswith("finish_reason=abort")
    n = int(line[0].split("stopped after ")[1].split()[0])
    assert 0 < n < 100 and text.endswith("\n")
    # what was printed is the answer's first n tokens (the last flush may add a U+FFFD for a
    # character whose bytes were cut)
    n = min(n, 30)
    assert text[:-1].rstrip("\ufffd").startswith(reference.llm.tokenizer.decode(full.token_ids[:n]).rstrip("\ufffd"))
