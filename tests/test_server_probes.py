"""What load-test clients meet at infhip-serve's door: HEAD on the probes and scrapes answers as
GET does without a body (aiperf probes HEAD /metrics), the access log can leave those out
(--access-log requests), and a 429's message names the Retry-After it sends, on each of its
three paths (count limit, prompt-token budget, expected wait)."""

from __future__ import annotations

import re
import socket
import time

import pytest

from infhip import LLM
from infhip.runtime.serving import admission as A
from infhip.runtime.serving.lifecycle import Lifecycle, Refused, ServingPolicy
from tests._serving import post, running_server, wait_for
from tests._tiny import API_ENGINE
from tests.test_server_lifecycle import _INFO, _FakeMetrics, raw_request

PROBES = ("/health", "/health/live", "/health/ready", "/metrics", "/version", "/v1/models")


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine(**API_ENGINE)


def test_head_answers_like_get_without_a_body(engine, caplog):
    caplog.set_level("INFO", logger="infhip.access")
    with running_server(LLM(engine), access_log="requests") as server:
        # accepted sockets inherit the listener's proto; asyncio sets TCP_NODELAY only when it says TCP
        assert server._socket.proto == socket.IPPROTO_TCP
        for path in PROBES:
            s_get, h_get, body = raw_request(server, "GET", path)
            s_head, h_head, empty = raw_request(server, "HEAD", path)
            assert (s_head, empty) == (s_get, b""), path
            assert s_get == 200 and body
            assert h_head["content-type"] == h_get["content-type"], path
            if path != "/metrics":  # the scrape's counters move between the two requests
                assert h_head["content-length"] == h_get["content-length"] == str(len(body)), path
        assert raw_request(server, "HEAD", "/v1/completions")[0] == 405  # generating routes stay POST-only
        assert post(server, {"prompt": "hi", "max_tokens": 1})[0] == 200
        # "requests": only the API's lines; the probes and scrapes above are left out
        lines = lambda: [r.getMessage() for r in caplog.records if r.name == "infhip.access"]  # noqa: E731
        assert wait_for(lambda: any("POST /v1/completions" in x for x in lines()), 5)
        time.sleep(0.1)
        paths = [re.search(r'"(\w+) (\S+) HTTP', x).group(2) for x in lines()]
        assert paths == ["/v1/models", "/v1/models", "/v1/completions", "/v1/completions"], paths
    caplog.clear()
    with running_server(LLM(engine)) as server:  # the default, as vLLM's: every request
        raw_request(server, "HEAD", "/metrics")
        assert wait_for(lambda: any('"HEAD /metrics' in r.getMessage() for r in caplog.records), 5)
    with pytest.raises(ValueError, match="access_log must be one of all, requests, off"):
        running_server(LLM(engine), access_log="some").__enter__()


def _says_its_retry_after(e: Refused) -> int:
    retry = int(e.headers["Retry-After"])
    said = re.search(r"retry in (\d+) s", e.message)
    assert said and int(said.group(1)) == retry, (e.message, e.headers)
    return retry


def test_429_body_and_retry_after_agree():
    # the count limit, with 4 running requests 0.3 s from their end: header 1, body "1 s" (was "0.3 s")
    lc = Lifecycle(ServingPolicy(max_waiting_requests=1), _INFO, None, _FakeMetrics())
    lc.throughput.observe(1000, 1.0)
    tickets = [lc.admit() for _ in range(4)]
    for t in tickets:
        t.start(0, 100)
        t.work.generated(25)
    with pytest.raises(Refused) as e:
        lc.admit()
    assert e.value.status == 429 and _says_its_retry_after(e.value) == A.retry_after(lc.first_leave_s()) == 1
    # the prompt-token budget (was "retry later")
    lc = Lifecycle(ServingPolicy(max_waiting_tokens=40), _INFO, None, _FakeMetrics())
    first, second = lc.admit(), lc.admit()
    first.add_prompt(500)
    with pytest.raises(Refused) as e:
        second.add_prompt(1)
    assert _says_its_retry_after(e.value) >= 1
    # the expected-wait bound: 25.6 s of work, bound 10 s -> 16 s in both
    lc = Lifecycle(ServingPolicy(max_queue_wait_s=10), _INFO, None, _FakeMetrics())
    lc.throughput.observe(1000, 1.0)
    for t in [lc.admit() for _ in range(A.FLOOR)]:
        t.start(10, 90)
    with pytest.raises(Refused) as e:
        lc.admit()
    assert _says_its_retry_after(e.value) == 16


def test_start_up_line_names_the_tokenizer_folder(engine, tmp_path):
    from infhip.runtime.server import _tokenizer_hint

    assert _tokenizer_hint(str(engine)) == f"; tokenizer for clients: {(engine / 'tokenizer').resolve()}"
    assert _tokenizer_hint(str(tmp_path)) == "; no tokenizer (token-id prompts only)"
