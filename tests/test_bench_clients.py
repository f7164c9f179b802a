"""The load-test clients people run against infhip-serve (tiny engine, loopback, a handful of
requests): guidellm 0.8.1 and aiperf 0.13.0.

Their bodies (captured from the real clients, 2026-12-07) are pinned here and answered with the
usage in every chunk (stream_options.continuous_usage_stats), as vLLM answers them: these
always run. The real clients run when installed (`guidellm` / `aiperf` on PATH, or the
executables in $INFHIP_GUIDELLM / $INFHIP_AIPERF): guidellm 0.8.1 needs datasets >= 5 and numpy 2,
which the triton-server extra's numpy < 2 forbids, so neither is in the `test` extra; install
each in its own venv (docs/serving.md, "Tested clients")."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from infhip import LLM
from tests._serving import counter, post, running_server, sse_events
from tests._tiny import API_ENGINE

GUIDELLM_CHAT = {"model": "infhip", "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                 "max_completion_tokens": 8, "ignore_eos": True,
                 "messages": [{"role": "user", "content": [{"type": "text", "text": "1 0 m0 Finish med"}]}]}
GUIDELLM_COMPLETIONS = {"model": "infhip", "stream": True,
                        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                        "max_tokens": 8, "ignore_eos": True, "prompt": "1 0 m0 Finish med"}
AIPERF_PER_CHUNK = {"messages": [{"role": "user", "content": "increase foison plen"}], "model": "infhip",
                    "stream": True, "max_completion_tokens": 8,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine(**API_ENGINE)


@pytest.fixture(scope="module")
def server(engine):
    with running_server(LLM(engine)) as srv:
        yield srv


@pytest.mark.parametrize("body", [GUIDELLM_CHAT, GUIDELLM_COMPLETIONS, AIPERF_PER_CHUNK],
                         ids=["guidellm-chat", "guidellm-completions", "aiperf-per-chunk-usage"])
def test_pinned_bodies_get_usage_in_every_chunk(server, body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, data = post(server, body, path)
    assert status == 200, data
    *chunks, last = sse_events(data)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == sum(
        len(c["choices"][0]["token_ids"]) for c in chunks)
    seen = 0
    for c in chunks:  # usage so far in each: completion tokens grow with the chunk's tokens
        seen += len(c["choices"][0]["token_ids"])
        assert c["usage"]["completion_tokens"] == seen and c["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"]
        assert c["usage"]["total_tokens"] == seen + c["usage"]["prompt_tokens"]
    if body.get("ignore_eos"):
        assert seen == 8


def test_continuous_usage_is_off_unless_asked(server):
    status, data = post(server, {**GUIDELLM_COMPLETIONS, "stream_options": {"include_usage": True}})
    *chunks, last = sse_events(data)
    assert status == 200 and all("usage" not in c for c in chunks) and last["usage"]["completion_tokens"] == 8


def _client(name: str) -> str | None:
    return os.environ.get(f"INFHIP_{name.upper()}") or shutil.which(name)


def _counts(server) -> tuple[float, float]:
    return counter(server.metrics.prompt_tokens), counter(server.metrics.generation_tokens)


@pytest.mark.parametrize("fmt", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_defaults_zero_errors(server, engine, tmp_path, fmt):
    exe = _client("guidellm")
    if exe is None:
        pytest.skip("guidellm is not installed (it cannot share the test env: see the module docstring)")
    before = _counts(server)
    out = tmp_path / "guidellm.json"
    run = subprocess.run([exe, "run", "--backend", f"kind=openai_http,target={server.url},request_format={fmt}",
                          "--profile", "kind=concurrent,streams=4", "--constraint", "kind=max_requests,count=8",
                          "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
                          "--tokenizer", f"kind=hf_auto,model={engine / 'tokenizer'}", "--disable-console",
                          "--output", f"kind=json,path={out}"], capture_output=True, text=True, timeout=240,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    metrics = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    assert metrics["request_totals"] == {"successful": 8, "errored": 0, "incomplete": 0, "total": 8}
    prompt, output = (metrics[k]["successful"]["total_sum"] for k in ("prompt_token_count", "output_token_count"))
    after = _counts(server)
    assert (prompt, output) == (after[0] - before[0], after[1] - before[1]) and output == 64


@pytest.mark.parametrize("flags", [[], ["--use-server-token-count", "--per-chunk-usage"]], ids=["defaults", "per-chunk"])
def test_aiperf_zero_errors(server, engine, tmp_path, flags):
    exe = _client("aiperf")
    if exe is None:
        pytest.skip("aiperf is not installed")
    before = _counts(server)
    run = subprocess.run([exe, "profile", "--model", "infhip", "--url", server.url, "--endpoint-type", "chat",
                          "--streaming", "--request-count", "8", "--concurrency", "4", "--tokenizer",
                          str(engine / "tokenizer"), "--isl", "16", "--osl", "8", "--ui", "none",
                          "--artifact-dir", str(tmp_path), *flags], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads((tmp_path / "profile_export_aiperf.json").read_text())
    assert report["request_count"]["avg"] == 8 and not report.get("error_request_count") and not report["error_summary"]
    after = _counts(server)
    generated = after[1] - before[1]
    assert 8 <= generated <= 64  # 8 requests of up to 8 tokens (aiperf sends no ignore_eos: EOS may come early)
    if flags:  # it reports the server's counts (by default it re-tokenizes the text itself: other numbers)
        assert (report["total_isl"]["avg"], report["total_osl"]["avg"]) == (after[0] - before[0], generated)


def test_vllm_request_fields_accepted_or_refused_by_name(server):
    """vLLM's extensions a client may send: ignored ones answer normally, the ones this engine does
    not implement are accepted at their neutral value and otherwise a 400 that names them."""
    base = {"prompt": "hi", "max_tokens": 2}
    extras = {"cache_salt": "s" * 43, "kv_transfer_params": {"x": 1}, "vllm_xargs": {"k": 1}, "include_reasoning": False,
              "guided_decoding_backend": "xgrammar", "mm_processor_kwargs": {}, "return_token_ids": True,
              "prompt_logprobs": None, "logits_processors": [], "stream": True,
              "stream_options": {"include_usage": True, "include_obfuscation": False}}
    status, data = post(server, {**base, **extras})
    assert status == 200 and sse_events(data)[-1]["usage"]["completion_tokens"] == 2
    for field, value in (("prompt_logprobs", 1), ("logits_processors", ["my.Proc"]), ("structural_tag", "{}")):
        status, data = post(server, {**base, field: value})
        assert status == 400 and field in json.loads(data)["error"]["message"], data
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, data = post(server, {**chat, "add_special_tokens": True}, "/v1/chat/completions")
    assert status == 400 and "add_special_tokens" in json.loads(data)["error"]["message"]
    assert post(server, {**chat, "add_special_tokens": False}, "/v1/chat/completions")[0] == 200
