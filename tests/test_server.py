"""infhip-serve over a tiny engine: completions equal LLM.generate (alone and under concurrent
requests), streaming equals the whole answer, a client leaving mid-stream frees its request, and
bad input gets 400 with the reason."""

from __future__ import annotations

import http.client
import json
import socket
import threading

import pytest

from infhip import LLM, SamplingParams
from infhip.runtime.server import make_server, parse_completion_request
from tests._tiny import build_tiny_api_engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return build_tiny_api_engine(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def server(engine):
    srv = make_server(LLM(engine), port=0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    srv.loop.close()


@pytest.fixture(scope="module")
def reference(engine):
    return LLM(engine)


def post(server, body, raw: bytes | None = None):
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
    conn.request("POST", "/v1/completions", body=raw if raw is not None else json.dumps(body),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def sse_events(data: bytes) -> list:
    lines = [line[len(b"data: "):] for line in data.split(b"\n\n") if line.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    return [json.loads(x) for x in lines[:-1]]


GREEDY = dict(max_tokens=10, temperature=0, ignore_eos=True)


def test_completion_equals_generate(server, reference):
    status, data = post(server, {"prompt": "hello world", **GREEDY})
    assert status == 200
    out = json.loads(data)
    want = reference.generate(["hello world"], SamplingParams(**GREEDY))[0]
    choice = out["choices"][0]
    assert choice["token_ids"] == want.token_ids and choice["text"] == want.text
    assert choice["finish_reason"] == "length" and out["object"] == "text_completion"
    assert out["usage"] == {"prompt_tokens": len(want.prompt_token_ids), "completion_tokens": 10,
                            "total_tokens": len(want.prompt_token_ids) + 10}
    ids = want.prompt_token_ids  # a prompt given as token ids gives the same completion
    assert json.loads(post(server, {"prompt": ids, **GREEDY})[1])["choices"][0]["token_ids"] == want.token_ids


def test_stream_equals_completion(server):
    whole = json.loads(post(server, {"prompt": "abc", **GREEDY})[1])["choices"][0]
    status, data = post(server, {"prompt": "abc", "stream": True, **GREEDY})
    events = sse_events(data)
    assert status == 200 and len(events) > 1
    assert "".join(e["choices"][0]["text"] for e in events) == whole["text"]
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == whole["token_ids"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])


def test_concurrent_requests_batch_and_match(server, reference):
    prompts = ["one two", "three", "four five six", "seven"]
    results = {}

    def run(p):
        results[p] = json.loads(post(server, {"prompt": p, **GREEDY})[1])["choices"][0]["token_ids"]

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in prompts:
        assert results[p] == reference.generate([p], SamplingParams(**GREEDY))[0].token_ids, p


def test_client_leaving_mid_stream_frees_its_request(server, monkeypatch):
    llm = server.loop.llm
    kv = llm.runner.kv
    free = {g: kv.num_free_pages(g) for g in kv.groups}  # nothing in flight between tests
    added, step = [], llm.step
    monkeypatch.setattr(llm, "_add", lambda *a, _add=llm._add: added.append(_add(*a)) or added[-1])
    monkeypatch.setattr(llm, "step", lambda: threading.Event().wait(0.02) or step())  # 100 tokens >= 2 s
    body = json.dumps({"prompt": "abc", "stream": True, "max_tokens": 100, "temperature": 0,
                       "ignore_eos": True}).encode()
    with socket.create_connection(server.server_address[:2], timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        got = b""
        while b"data: " not in got:  # the headers and the first event
            got += sock.recv(4096)
        assert got.startswith(b"HTTP/1.1 200")
    # left after the first event: the next write fails and the engine aborts the request
    # the engine aborts it on the next write; afterwards nothing is left running or holding pages
    status, _ = post(server, {"prompt": "xyz", **GREEDY})
    assert status == 200
    for _ in range(200):  # the abort is the engine thread's; give it a moment
        if not server.loop._live:
            break
        threading.Event().wait(0.05)
    assert not server.loop._live and not llm._requests
    assert added[0].seq.finish_reason == "abort" and len(added[0].seq.output_token_ids) < 100
    assert {g: kv.num_free_pages(g) for g in kv.groups} == free


@pytest.mark.parametrize("body,needle", [
    (b"not json", "not JSON"),
    (b"[1, 2]", "JSON object"),
    (json.dumps({"prompt": "x", "max_token": 3}).encode(), "unknown field(s) max_token"),
    (json.dumps({"prompt": 5}).encode(), "\"prompt\" must be"),
    (json.dumps({"prompt": []}).encode(), "\"prompt\" must be"),
    (json.dumps({"prompt": "x", "temperature": -1}).encode(), "temperature"),
    (json.dumps({"prompt": "x", "stream": "yes"}).encode(), "\"stream\""),
    (json.dumps({"prompt": [10 ** 9]}).encode(), "token ids must be in"),
    (json.dumps({"prompt": "word " * 400}).encode(), "exceeds max_seq_len"),
])
def test_bad_requests_get_400_with_the_reason(server, body, needle):
    status, data = post(server, None, raw=body)
    assert status == 400, data
    assert needle in json.loads(data)["error"]["message"]


def test_bad_content_length_gets_400(server):
    for header in (b"-5", b"abc"):
        with socket.create_connection(server.server_address[:2], timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + header + b"\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 400"), header


def test_health_models_and_unknown_paths(server):
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    for path, status in (("/health", 200), ("/v1/models", 200), ("/nope", 404)):
        conn.request("GET", path)
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert resp.status == status, path
    assert body["error"]["code"] == 404
    conn.close()


def test_parse_completion_request_defaults():
    text, ids, params, stream = parse_completion_request(b'{"prompt": "hi"}')
    assert (text, ids, stream) == ("hi", None, False) and params == SamplingParams()
