"""infhip-serve under load (tiny engine, 64 sequences per step, real uvicorn on loopback):
128 concurrent streaming clients all get exactly the answer of their request run alone, and 64
clients leaving mid-request (32 streaming, 32 not) leave the engine idle with every KV page
back within 2 s."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from infhip import LLM, SamplingParams
from tests._serving import counter, engine_is_idle, kv_free_pages, post, running_server, wait_for
from tests._tiny import API_ENGINE

WORDS = ("In the beginning God created the heaven and the earth and the earth was without form and void "
         "and darkness was upon the face of the deep").split()
PROMPTS = [" ".join(WORDS[:n]) for n in range(1, 33, 2)]  # 16 prompts, 1 to 31 words
GREEDY = dict(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine(**{**API_ENGINE, "max_batch_size": 64})


@pytest.fixture(scope="module")
def server(engine):
    with running_server(LLM(engine)) as srv:
        yield srv


@pytest.fixture(scope="module")
def alone(engine):
    """prompt -> its greedy RequestOutput generated alone."""
    llm = LLM(engine)
    return {p: llm.generate([p], SamplingParams(**GREEDY))[0] for p in PROMPTS}


async def stream_one(client: httpx.AsyncClient, prompt: str) -> tuple[str, list[int], list[str]]:
    """(text, token ids, problems) of one streamed completion; a problem is anything that is not
    a well-formed chunk of this request, or a missing end."""
    problems = []
    async with client.stream("POST", "/v1/completions", json={"prompt": prompt, "stream": True, **GREEDY}) as r:
        if r.status_code != 200 or not r.headers["content-type"].startswith("text/event-stream"):
            return "", [], [f"status {r.status_code}"]
        body = (await r.aread()).decode()
    blocks = body.split("\n\n")
    if blocks[-2:] != ["data: [DONE]", ""]:
        problems.append(f"does not end with [DONE]: {body[-80:]!r}")
    text, ids, reasons = "", [], []
    for block in blocks[:-2]:
        try:
            assert block.startswith("data: ")
            [choice] = json.loads(block[len("data: "):])["choices"]
            text += choice["text"]
            ids += choice["token_ids"]
            reasons.append(choice["finish_reason"])
        except (AssertionError, ValueError, KeyError) as e:
            problems.append(f"malformed event {block[:80]!r} ({e!r})")
    if reasons[-1:] != ["length"] or any(reasons[:-1]):
        problems.append(f"finish reasons {reasons}")
    return text, ids, problems


def test_128_concurrent_streaming_clients(server, alone):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(128)]

    async def run():
        limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as client:
            return await asyncio.gather(*(stream_one(client, p) for p in prompts), return_exceptions=True)

    start = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - start
    lost = [r for r in results if isinstance(r, BaseException)]
    assert not lost, f"{len(lost)} of 128 lost, e.g. {lost[0]!r}"
    malformed = [(p, r[2]) for p, r in zip(prompts, results) if r[2]]
    assert not malformed, f"{len(malformed)} malformed, e.g. {malformed[0]}"
    wrong = [p for p, (text, ids, _) in zip(prompts, results) if (text, ids) != (alone[p].text, alone[p].token_ids)]
    assert not wrong, f"{len(wrong)} differ from the request run alone, e.g. {wrong[0]!r}"
    assert elapsed < 60


def test_256_concurrent_streaming_clients_all_answered_by_default(server):
    """The official client with max_retries=0, 256 streams at once on the default admission
    (the old default, batch + 2 x batch = 192 here, refused 64 of them with 429)."""
    import openai
    assert server.lifecycle.max_requests is None  # default policy: the time rule
    rejected = counter(server.metrics.rejected, reason="queue_wait"), counter(server.metrics.rejected, reason="queue_full")

    async def one(client, i: int):
        stream = await client.completions.create(model="infhip",
                                                 prompt=PROMPTS[i % len(PROMPTS)], max_tokens=2, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        return chunks[-1].usage.completion_tokens

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(256)), return_exceptions=True)
    start = time.monotonic()
    results = asyncio.run(run())
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} of 256 failed, e.g. {failed[0]!r}"
    assert results == [2] * 256
    assert (counter(server.metrics.rejected, reason="queue_wait"),
            counter(server.metrics.rejected, reason="queue_full")) == rejected
    assert time.monotonic() - start < 120


async def leave_mid_request(server, stream: bool, generating: asyncio.Event) -> None:
    """Send a long request, leave once every request of the storm is generating."""
    body = json.dumps({"prompt": "In the beginning", "stream": stream, "max_tokens": 110, "temperature": 0,
                       "ignore_eos": True}).encode()
    reader, writer = await asyncio.open_connection(*server.server_address)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    await generating.wait()
    writer.close()
    await writer.wait_closed()


def test_64_clients_leaving_mid_request_free_everything(server, alone, monkeypatch):
    core, metrics = server.loop.core, server.metrics
    free = kv_free_pages(core)
    aborts = counter(metrics.aborts)
    step, delta = core.step, metrics.delta
    monkeypatch.setattr(core, "step", lambda: time.sleep(0.02) or step())  # 110 tokens >= 2.2 s: still generating

    async def storm():
        loop, generating, started = asyncio.get_running_loop(), asyncio.Event(), set()

        def count_started(req, d):  # on the engine thread: all 64 requests have a token -> leave
            if req.seq.seq_id not in started:
                started.add(req.seq.seq_id)
                if len(started) == 64:  # once: this event loop is closed after the storm
                    loop.call_soon_threadsafe(generating.set)
            delta(req, d)
        monkeypatch.setattr(metrics, "delta", count_started)
        await asyncio.wait_for(asyncio.gather(*(leave_mid_request(server, i % 2 == 0, generating)
                                                for i in range(64))), 60)
    asyncio.run(storm())
    left = time.monotonic()
    assert wait_for(lambda: engine_is_idle(server, free), 2.0), (server.loop.num_live, kv_free_pages(core), free)
    assert time.monotonic() - left < 2.0
    assert counter(metrics.aborts) - aborts == 64
    monkeypatch.undo()
    status, data = post(server, {"prompt": PROMPTS[3], **GREEDY})
    assert status == 200 and json.loads(data)["choices"][0]["token_ids"] == alone[PROMPTS[3]].token_ids
