"""infhip-serve's lifecycle in-process (tiny engine, real uvicorn on loopback, steps slowed where
a request must still be running): admission limits give 429 to the excess and full answers to
the admitted; a deadline aborts a request (queued or generating, streaming or not) and frees its
KV pages; /health/live and /health/ready flip at the right moments; drain() turns new requests
into 503; a client trickling its headers is dropped after the header timeout while others are
served; --api-key, /tokenize, /detokenize, /version and the request-latency metrics. The real
signals on a real process: tests/test_server_drain.py."""

from __future__ import annotations

import json
import socket
import threading
import time

import openai
import pytest

from infhip import LLM, SamplingParams
from infhip.runtime.core_readouts import kv_capacity_tokens
from infhip.runtime.outputs import EngineInfo
from infhip.runtime.serving.lifecycle import Lifecycle, Refused, ServingPolicy
from tests._serving import (counter, engine_is_idle, error_of, kv_free_pages, post, request, running_server,
                            server_thread, sse_events, wait_for)
from tests._tiny import API_ENGINE

GREEDY = dict(temperature=0, ignore_eos=True)
STEP_DELAY_S = 0.03  # a slowed step: 30 tokens take >= 0.9 s


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine(**API_ENGINE)  # 4 sequences per step


@pytest.fixture(scope="module")
def reference(engine):
    return LLM(engine)


def slowed(llm: LLM, delay_s: float = STEP_DELAY_S) -> LLM:
    step = llm.core.step
    llm.core.step = lambda: time.sleep(delay_s) or step()
    return llm


def ids_alone(reference, prompt: str, max_tokens: int) -> list[int]:
    return reference.generate([prompt], SamplingParams(max_tokens=max_tokens, **GREEDY))[0].token_ids


def in_parallel(fn, args: list) -> list:
    """fn(arg) for each arg on its own thread, started together; results in order."""
    out = [None] * len(args)

    def run(i):
        out[i] = fn(args[i])
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def raw_request(server, method: str, path: str, body=None, headers=None):
    """(status, headers, body) on a fresh connection."""
    import http.client
    conn = http.client.HTTPConnection(*server.server_address, timeout=60)
    data = None if body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    out = resp.status, dict(resp.getheaders()), resp.read()
    conn.close()
    return out


# -- admission --------------------------------------------------------------------------------------
def test_overload_gets_429_and_the_admitted_get_full_answers(engine, reference):
    policy = ServingPolicy(max_waiting_requests=1)  # 4 running + 1 waiting
    with running_server(slowed(LLM(engine)), policy=policy) as server:
        assert server.lifecycle.max_requests == 5
        prompts = [f"word {i}" for i in range(8)]
        body = lambda p: {"prompt": p, "max_tokens": 30, **GREEDY}  # noqa: E731
        ready_while_full = []

        def probe():
            wait_for(lambda: server.lifecycle.requests_in == 5, 10)
            ready_while_full.append(request(server, "GET", "/health/ready")[0])
        prober = threading.Thread(target=probe)
        prober.start()
        answers = in_parallel(lambda p: raw_request(server, "POST", "/v1/completions", body(p)), prompts)
        prober.join()
        ok = [(p, json.loads(b)) for p, (s, _, b) in zip(prompts, answers) if s == 200]
        refused = [(h, b) for s, h, b in answers if s == 429]
        assert len(ok) == 5 and len(refused) == 3, [a[0] for a in answers]
        for p, out in ok:
            assert out["choices"][0]["token_ids"] == ids_alone(reference, p, 30)
        for headers, data in refused:
            err = error_of(data)  # Retry-After: the expected wait (checked in tests/test_server_admission.py)
            assert int(headers["retry-after"]) >= 1 and err["code"] == 429 and "--max-waiting-requests" in err["message"]
        assert ready_while_full == [503]
        assert request(server, "GET", "/health/ready")[0] == 200  # emptied again
        assert b'infhip_requests_rejected_total{reason="queue_full"} 3.0' in request(server, "GET", "/metrics")[1]


class _FakeKV:
    page_size = 16

    def __init__(self):
        from infhip.runtime.kv_cache import KVGroupSpec
        self.groups = {"global": KVGroupSpec(num_pages=11, window=None), "sliding": KVGroupSpec(3, window=8)}


# a batch of 3; 10 full-attention pages of 16 tokens (the sliding group's do not bound it)
_INFO = EngineInfo(vocab_size=300, max_seq_len=64, max_num_seqs=3, kv_capacity_tokens=kv_capacity_tokens(_FakeKV()))


class _FakeMetrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter
        self.rejected = Counter("r", "r", ["reason"], registry=CollectorRegistry())


def test_admission_limits_and_deadlines_by_rule():
    """The rule without a server: defaults derived from the engine, the prompt-token budget (a
    request alone always gets in), the deadline's cap."""
    assert _INFO.kv_capacity_tokens == 10 * 16  # the full-attention group's 10 pages, not the window's
    lc = Lifecycle(ServingPolicy(), _INFO, None, _FakeMetrics())
    # no count limit by default (the time rule: tests/test_server_admission.py); queued prompts
    # may hold 16M tokens past the cache (host memory only)
    assert (lc.max_requests, lc.max_prompt_tokens) == (None, 160 + (1 << 24))
    lc = Lifecycle(ServingPolicy(max_waiting_requests=1, max_waiting_tokens=40, request_timeout_s=5), _INFO,
                   None, _FakeMetrics())
    assert (lc.max_requests, lc.max_prompt_tokens) == (4, 200)
    big = lc.admit()
    big.add_prompt(500)  # alone in the server: let in whatever its size (the engine judges it)
    second = lc.admit()
    with pytest.raises(Refused) as e:
        second.add_prompt(1)
    assert e.value.status == 429 and "--max-waiting-tokens" in e.value.message
    assert e.value.headers == {"Retry-After": "1"}
    big.release()
    big.release()  # idempotent
    second.add_prompt(150)
    third, fourth = lc.admit(), lc.admit()
    third.add_prompt(50)  # 200: at the limit
    with pytest.raises(Refused):
        fourth.add_prompt(1)
    lc.admit()  # the 4th request in the server
    with pytest.raises(Refused) as e:
        lc.admit()
    assert e.value.status == 429 and "--max-waiting-requests" in e.value.message
    assert counter(lc.metrics.rejected, reason="prompt_tokens") == 2
    assert counter(lc.metrics.rejected, reason="queue_full") == 1
    t = second.arrived
    assert second.deadline(None) == t + 5 and second.deadline(2) == t + 2 and second.deadline(60) == t + 5
    no_cap = Lifecycle(ServingPolicy(), _INFO, None, _FakeMetrics()).admit()
    assert no_cap.deadline(None) is None and no_cap.deadline(60) == no_cap.arrived + 60
    for bad in (dict(drain_timeout_s=-1), dict(max_waiting_requests=-1), dict(request_timeout_s=float("inf")),
                dict(retry_after_s=0), dict(api_key=""), dict(max_queue_wait_s=0), dict(max_queue_wait_s=True)):
        with pytest.raises(ValueError, match="ServingPolicy"):
            ServingPolicy(**bad)


# -- deadlines --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slow_server(engine):
    with running_server(slowed(LLM(engine))) as server:
        yield server


LONG = {"prompt": "abc", "max_tokens": 100, **GREEDY}  # >= 3 s at the slowed step


@pytest.mark.parametrize("stream", [False, True])
def test_deadline_aborts_and_frees_pages(slow_server, reference, stream):
    server = slow_server
    free = kv_free_pages(server.loop.core)
    before = counter(server.metrics.timeouts)
    start = time.monotonic()
    status, data = post(server, {**LONG, "timeout": 0.6, "stream": stream})
    took = time.monotonic() - start
    assert 0.6 <= took < 3.0, took
    if stream:
        assert status == 200
        events = sse_events(data)  # ends with [DONE]
        *deltas, last = events
        ids = [t for e in events for t in e["choices"][0]["token_ids"]]
        assert last["choices"][0]["finish_reason"] == "abort"
        assert all(e["choices"][0]["finish_reason"] is None for e in deltas)
        assert 0 < len(ids) < 100 and ids == ids_alone(reference, "abc", 100)[:len(ids)]
    else:
        err = error_of(data)
        assert status == 504 and err["type"] == "timeout" and "timeout=0.6 s" in err["message"], err
    assert wait_for(lambda: engine_is_idle(server, free), 2.0)
    assert counter(server.metrics.timeouts) == before + 1


def test_deadline_counts_queue_time(slow_server, reference):
    """Four long requests fill the engine's 4 slots; a fifth with a deadline shorter than their
    generation waits in the queue the whole time and is aborted there, with no token."""
    server = slow_server
    free = kv_free_pages(server.loop.core)
    results = {}

    def long_one(i):
        results[i] = post(server, {**LONG, "max_tokens": 60, "prompt": f"slot {i}"})[0]
    threads = [threading.Thread(target=long_one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    assert wait_for(lambda: server.loop.core.num_running == 4, 10)
    status, data = post(server, {**LONG, "timeout": 0.4})
    assert status == 504 and "after 0 generated tokens" in error_of(data)["message"]
    for t in threads:
        t.join()
    assert list(results.values()) == [200] * 4
    assert wait_for(lambda: engine_is_idle(server, free), 2.0)


def test_bad_timeout_is_400(slow_server):
    for bad in (0, -1, "1"):
        status, data = post(slow_server, {"prompt": "a", "timeout": bad})
        assert status == 400 and "timeout" in error_of(data)["message"]


# -- health and drain ------------------------------------------------------------------------------
def test_health_live_ready_and_drain(engine, reference):
    with running_server(slowed(LLM(engine)), policy=ServingPolicy(drain_timeout_s=30)) as server:
        assert [request(server, "GET", p)[0] for p in ("/health", "/health/live", "/health/ready")] == [200] * 3
        out = {}
        worker = threading.Thread(target=lambda: out.update(r=post(server, {**LONG, "max_tokens": 40})))
        worker.start()
        assert wait_for(lambda: server.loop.num_live == 1, 10)
        server.drain()
        assert wait_for(lambda: server.lifecycle.draining, 2)
        status, data = request(server, "GET", "/health/ready")
        assert status == 503 and "draining" in error_of(data)["message"]
        assert request(server, "GET", "/health/live")[0] == 200 and request(server, "GET", "/health")[0] == 200
        status, headers, data = raw_request(server, "POST", "/v1/completions", {"prompt": "late"})
        assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
        assert "shutting down" in error_of(data)["message"]
        worker.join()
        status, data = out["r"]  # the running request finished in full
        assert status == 200 and json.loads(data)["choices"][0]["token_ids"] == ids_alone(reference, "abc", 40)
        server_thread(server).join(10)
        assert not server_thread(server).is_alive()  # the drain ended the server by itself


def test_live_turns_503_when_a_step_stalls(engine):
    llm = LLM(engine)
    step, gate = llm.core.step, threading.Event()
    llm.core.step = lambda: gate.wait(30) and step()
    with running_server(llm, policy=ServingPolicy(stall_timeout_s=0.3)) as server:
        worker = threading.Thread(target=lambda: post(server, {"prompt": "a", "max_tokens": 2}))
        worker.start()
        assert wait_for(lambda: request(server, "GET", "/health/live")[0] == 503, 5)
        status, data = request(server, "GET", "/health/live")
        assert "has run for" in error_of(data)["message"] and request(server, "GET", "/health/ready")[0] == 503
        gate.set()
        worker.join()
        assert request(server, "GET", "/health/live")[0] == 200


# -- header timeout -----------------------------------------------------------------------------------
def test_header_trickler_is_dropped_while_others_are_served(engine):
    with running_server(LLM(engine), policy=ServingPolicy(header_timeout_s=0.8)) as server:
        head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
        start = time.monotonic()
        with socket.create_connection(server.server_address, timeout=10) as slow:
            got, served = b"", []
            for byte in head:
                try:
                    slow.sendall(bytes([byte]))
                except OSError:  # closed under us: the timeout fired
                    break
                if not served:
                    served.append(request(server, "GET", "/health")[0])  # another client meanwhile
                time.sleep(0.05)
                if time.monotonic() - start > 3:
                    break
            slow.settimeout(3)
            try:
                while chunk := slow.recv(4096):
                    got += chunk
            except OSError:
                pass
        took = time.monotonic() - start
        assert served == [200]
        assert got.startswith(b"HTTP/1.1 408 ") and b"--header-timeout" in got, got[:200]
        assert 0.8 <= took < 2.5, took
        # a keep-alive connection that sends its next request after a pause longer than the
        # header timeout is not cut: the timer starts at that request's first byte
        import http.client
        conn = http.client.HTTPConnection(*server.server_address, timeout=10)
        for _ in range(2):
            conn.request("GET", "/health")
            assert conn.getresponse().read() and True
            time.sleep(1.0)
        conn.close()


# -- API key, tokenize / detokenize / version, metrics -----------------------------------------
def test_api_key(engine):
    with running_server(LLM(engine), policy=ServingPolicy(api_key="sekret")) as server:
        status, headers, data = raw_request(server, "GET", "/v1/models")
        assert status == 401 and headers["www-authenticate"] == "Bearer" and "--api-key" in error_of(data)["message"]
        assert raw_request(server, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert raw_request(server, "POST", "/tokenize", {"prompt": "a"})[0] == 401
        assert raw_request(server, "GET", "/v1/models", headers={"Authorization": "Bearer sekret"})[0] == 200
        for open_path in ("/health", "/health/ready", "/metrics", "/version"):
            assert request(server, "GET", open_path)[0] == 200, open_path
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="sekret", max_retries=0)
        assert client.completions.create(model="infhip", prompt="a", max_tokens=2).choices[0].text is not None
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_tokenize_detokenize_version(slow_server, reference):
    server, tok = slow_server, reference.tokenizer
    status, data = post(server, {"prompt": "hello world"}, "/tokenize")
    out = json.loads(data)
    assert status == 200 and out["tokens"] == tok("hello world")["input_ids"] and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 128
    bare = json.loads(post(server, {"prompt": "hello world", "add_special_tokens": False}, "/tokenize")[1])
    assert bare["tokens"] == tok("hello world", add_special_tokens=False)["input_ids"]
    messages = [{"role": "user", "content": "hi"}]
    chat = json.loads(post(server, {"messages": messages}, "/tokenize")[1])["tokens"]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == tok(text, add_special_tokens=False)["input_ids"]
    status, data = post(server, {"tokens": out["tokens"]}, "/detokenize")
    assert status == 200 and json.loads(data)["prompt"] == tok.decode(out["tokens"])
    from infhip import __version__
    assert json.loads(request(server, "GET", "/version")[1]) == {"version": __version__}
    for path, body, needle in (("/tokenize", {"prompt": "a", "messages": messages}, "exactly one"),
                               ("/tokenize", {}, "exactly one"), ("/detokenize", {"tokens": [10 ** 6]}, "[0, 300)"),
                               ("/detokenize", {"tokens": "ab"}, "tokens")):
        status, data = post(server, body, path)
        assert status == 400 and needle in error_of(data)["message"], (body, data)


def test_request_latency_metrics(slow_server):
    server = slow_server
    assert post(server, {"prompt": "abc", "max_tokens": 5, **GREEDY})[0] == 200
    text = request(server, "GET", "/metrics")[1].decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line[:1] != "#"}
    for name in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time",
                 "time_per_output_token"):
        key = f"infhip_{name}_seconds" if name != "time_per_output_token" else "infhip_time_per_output_token_seconds"
        assert values[key + "_count"] >= 1, name
    # 5 tokens at >= 30 ms a step: decode >= 4 steps, time per output token >= the step delay
    assert values["infhip_request_decode_time_seconds_sum"] >= 4 * STEP_DELAY_S
    assert values["infhip_time_per_output_token_seconds_sum"] / values["infhip_time_per_output_token_seconds_count"] \
        >= STEP_DELAY_S * 0.9
    assert values['infhip_request_success_total{finish_reason="length"}'] >= 1
    assert values['infhip_kv_cache_usage_ratio{group="global"}'] == 0.0  # idle again
