"""infhip-bench (runtime/bench/) on tiny CPU engines: latency, throughput and long print a table
and write real numbers to JSON; serve measures our server and a minimal OpenAI-compatible stub
(another engine's server, as far as the client can tell) with vLLM's result rows."""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from infhip import LLM
from infhip.runtime.bench.cli import main
from infhip.runtime.bench.offline import dense_overrides
from infhip.runtime.bench.stats import SERVE_ROWS, percentile
from tests._serving import running_server
from tests._tiny import API_ENGINE

# a 3k engine whose plan goes sparse past 30 tokens (tests/test_aot_coverage.py's stages)
TINY_3K = dict(n_sink=4, n_stream=8, stages=[(8, 16, 32), (8, 2, 16), (8, 1, 8)], special_layers=[0],
               special_final_k=16, dense_threshold=30)


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine(**API_ENGINE)


def _run(capsys, tmp_path, *argv) -> tuple[dict, str]:
    out = tmp_path / "r.json"
    assert main([*map(str, argv), "--json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def _positive(*xs) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in xs)


def test_percentile_interpolates_as_numpy():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5 and math.isnan(percentile([], 50))
    assert percentile([0, 10], 99) == pytest.approx(9.9)


def test_latency_and_throughput(engine, capsys, tmp_path):
    r, table = _run(capsys, tmp_path, "latency", "--engine", engine, "--input-len", 12, "--output-len", 4,
                    "--num-iters", 3, "--num-iters-warmup", 1)
    lat = r["latency"]
    assert len(lat["latencies_s"]) == 3
    assert _positive(*lat["latency_ms"].values(), *lat["ttft_ms"].values(), *lat["tpot_ms"].values())
    assert lat["ttft_ms"]["mean"] < lat["latency_ms"]["mean"]  # the first token comes before the last
    assert "latency p99 ms" in table and "tpot median ms" in table
    r, table = _run(capsys, tmp_path, "throughput", "--engine", engine, "--num-prompts", 6, "--input-len", 10,
                    "--output-len", 3, "--no-progress")
    t = r["throughput"]
    assert (t["num_requests"], t["total_input_tokens"], t["total_output_tokens"]) == (6, 60, 18)
    assert _positive(t["requests_per_s"], t["output_tokens_per_s"]) and "output tok/s" in table
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "In the beginning", "output_len": 2}\n{"input_len": 7, "output_len": 5}\n')
    t = _run(capsys, tmp_path, "throughput", "--engine", engine, "--dataset", data)[0]["throughput"]
    assert t["num_requests"] == 2 and t["total_output_tokens"] == 7


def test_long_runs_the_plan_and_dense(tiny_engine, capsys, tmp_path):
    engine = tiny_engine(tokenizer=True, max_seq_len=128, preset="3k", infinitehip_overrides=TINY_3K,
                         hf=dict(num_hidden_layers=2))
    from infhip.config import EngineConfig
    assert dense_overrides(EngineConfig.load(engine)) == {"infinitehip": {"dense_threshold": 129}}
    r, table = _run(capsys, tmp_path, "long", "--engine", engine, "--contexts", "24,48", "--output-len", 3,
                    "--plot", tmp_path / "long.png")
    rows = r["long"]
    assert [(x["label"], x["context"]) for x in rows] == [("plan (3k)", 24), ("plan (3k)", 48), ("dense", 24),
                                                         ("dense", 48)]
    assert all(_positive(x["ttft_ms"], x["decode_tok_s"]) and x["output_tokens"] == 3 for x in rows)
    assert "plan (3k)" in table and "decode tok/s" in table
    assert (tmp_path / "long.png").read_bytes()[:4] == b"\x89PNG"


class _Stub(BaseHTTPRequestHandler):
    """A minimal OpenAI-compatible completions server: streams max_tokens text events of
    "x" (no token ids, no usage: the client counts events), 5 ms apart."""

    protocol_version = "HTTP/1.1"
    seen: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Stub.seen.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = [{"choices": [{"index": 0, "text": "x", "finish_reason": None}]} for _ in range(body["max_tokens"])]
        for e in events + ["[DONE]"]:
            time.sleep(0.005)
            data = f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args):
        pass


def _check_serve(r: dict, n: int, output_len: int) -> None:
    assert r["completed"] == n and r["failed"] == 0 and r["total_output_tokens"] == n * output_len
    assert set(k for _, k in SERVE_ROWS if k) <= set(r)
    assert _positive(r["request_throughput"], r["output_throughput"], r["mean_ttft_ms"], r["p99_ttft_ms"],
                     r["median_tpot_ms"], r["mean_itl_ms"])


def test_serve_against_our_server_and_a_stub(engine, capsys, tmp_path):
    with running_server(LLM(engine)) as server:
        r, out = _run(capsys, tmp_path, "serve", "--url", f"{server.url}/v1", "--concurrency", "1,3",
                      "--num-prompts", 4, "--input-len", 8, "--output-len", 3, "--no-progress")
    for res in r["serve"]:
        _check_serve(res, 4, 3)
        assert res["total_input_tokens"] == 4 * 8  # the server's usage
    assert [res["max_concurrency"] for res in r["serve"]] == [1, 3]
    assert out.count("Serving Benchmark Result") == 2 and "Median TPOT (ms):" in out and "P99 ITL (ms):" in out
    stub = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    try:
        r, _ = _run(capsys, tmp_path, "serve", "--url", f"http://127.0.0.1:{stub.server_address[1]}",
                    "--concurrency", 2, "--num-prompts", 3, "--input-len", 5, "--output-len", 4, "--model", "m",
                    "--no-progress")
    finally:
        stub.shutdown()
    _check_serve(r["serve"][0], 3, 4)
    assert r["serve"][0]["median_itl_ms"] >= 4  # the stub's 5 ms between events
    assert {b["model"] for b in _Stub.seen} == {"m"} and all(len(b["prompt"]) == 5 for b in _Stub.seen)


def test_serve_with_no_server_fails_clearly(capsys):
    assert main(["serve", "--url", "http://127.0.0.1:9", "--concurrency", "1", "--num-prompts", "1",
                 "--no-progress"]) == 2
    assert "no request to http://127.0.0.1:9 succeeded" in capsys.readouterr().err
