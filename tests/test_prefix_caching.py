"""Automatic prefix caching on engines (issue 24, docs/design/prefix_caching.md): reuse across
requests and within one batch giving the same greedy tokens as no cache on a tiny Llama and a tiny
Gemma-3, evicted pages poisoned with NaN, refcounts under abort, no extra preemption, which plans
turn it off, and the HTTP field. The KV manager alone: tests/test_prefix_cache_pages.py."""

from __future__ import annotations

import json

import pytest
import torch

from infhip import LLM, SamplingParams
from infhip.runtime.prefix_cache import PagePool
from infhip.runtime.sequence import Sequence
from tests._serving import post, request, running_server

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- engines ----------------------------------------------------------------------------------
KW = dict(max_seq_len=128, max_batch_size=3)


@pytest.fixture(scope="module")
def llama(tiny_engine):
    return tiny_engine("llama", **KW)


@pytest.fixture(scope="module")
def llama_fp8(tiny_engine):  # dense prefill reads fp8 keys back from the cache: reuse is exact too
    return tiny_engine("llama", kv_dtype="fp8", **KW)


@pytest.fixture(scope="module")
def gemma(tiny_engine):
    return tiny_engine("gemma3", **KW)


def _workload() -> list[list[int]]:
    """Questions over two documents: page-aligned and not, one the whole document, repeats, one
    that leaves the document at the last token of a page."""
    doc_a, doc_b = ids(1, 40), ids(2, 50)
    return [doc_a + ids(3, 9), doc_b + ids(4, 3), doc_a + ids(5, 20), doc_a[:32], doc_a + ids(3, 9),
            doc_b + ids(6, 30), doc_a[:17] + ids(7, 5), doc_a[:31] + ids(9, 10)]  # the last: page 1 differs in its last token


@pytest.mark.parametrize("arch", ["llama", "gemma", "llama_fp8"])
def test_greedy_equal_to_no_cache(arch, request):
    """Across requests (one after another, and a follow-up that extends an answer) and within one
    batch (chunked prefill admits later requests after the earlier ones filled pages)."""
    engine = request.getfixturevalue(arch)
    on = LLM(engine, max_num_batched_tokens=24)
    off = LLM(engine, max_num_batched_tokens=24, prefix_caching=False)
    assert on.core.prefix_caching and not off.core.prefix_caching
    prompts = _workload()
    batch = on.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    want = off.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in batch] == [w.token_ids for w in want]
    assert any(o.num_cached_tokens for o in batch), "within one batch some request reuses pages"
    assert all(w.num_cached_tokens == 0 for w in want)
    for p, w in zip(prompts, want):
        out = on.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0]
        assert out.token_ids == w.token_ids and out.num_cached_tokens == 16 * ((len(p) - 1) // 16)
    assert on.generate(prompt_token_ids=[prompts[0][:31] + ids(11, 4)], sampling_params=GREEDY)[0].num_cached_tokens == 16
    for p in prompts:  # the logits themselves, not only their argmax (a tiny random model is forgiving)
        assert torch.allclose(last_logits(on, p), last_logits(off, p), rtol=1e-5, atol=1e-5)
    follow = prompts[0] + want[0].token_ids + ids(8, 20)  # a second turn: reuses pages written by decode
    out, ref = (llm.generate(prompt_token_ids=[follow], sampling_params=GREEDY)[0] for llm in (on, off))
    assert out.token_ids == ref.token_ids and out.num_cached_tokens == 48
    stats = on.stats()
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_queries > stats.prefix_cache_hits
    assert all(n == 0 for n in stats.kv_pages_used.values())


def last_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """The logits of the prompt's last token, through scheduler and runner (as
    tests/test_runtime_vs_hf.py does)."""
    seq = Sequence(seq_id=10_000, prompt_token_ids=prompt, params=SamplingParams(max_tokens=1))
    llm.scheduler.add(seq)
    while True:
        out = llm.scheduler.schedule()
        logits = llm.runner.execute(out)
        if out.chunks[0].needs_logits:
            llm.scheduler.finish(seq, "abort")
            return logits[0]
        llm.scheduler.update(out, {}, ())


def _poison_free_pages(llm) -> None:
    """NaN into every page that is neither held nor cached (in every layer's K and V)."""
    kv_manager = llm.runner.kv
    for g in kv_manager.groups:
        pages = kv_manager.free_page_ids(g)
        for layer in llm.engine.model.layers:
            kv = layer.self_attn.kv
            if layer.self_attn.kv_group == g and pages:
                kv.k[pages] = float("nan")
                kv.v[pages] = float("nan")


# 8 pages of the global layers (4 KiB per layer): Llama's 3 layers; Gemma-3's 1 global layer after
# its 6 sliding ones take what 3 sequences' windows need (13 pages)
@pytest.mark.parametrize("arch,kv_bytes", [("llama", 9 * 3 * 4096), ("gemma", (13 * 6 + 9) * 4096)])
def test_eviction_under_pressure_with_poisoned_pages(arch, kv_bytes, request, monkeypatch):
    engine = request.getfixturevalue(arch)
    small = dict(max_num_batched_tokens=32, kv_cache_memory_bytes=kv_bytes, max_num_seqs=3)
    on, off = LLM(engine, **small), LLM(engine, prefix_caching=False, max_num_batched_tokens=32)
    layers = on.engine.model.layers
    evict = PagePool.allocate

    def poisoning_allocate(pool):  # an evicted page is NaN until its new owner writes it
        before = pool.num_evictions
        page = evict(pool)
        if pool.num_evictions != before:  # only `on` evicts: `off` names no page
            assert not pool.host
            for layer in layers:
                if layer.self_attn.kv_group != pool.group:
                    continue
                layer.self_attn.kv.k[page] = float("nan")
                layer.self_attn.kv.v[page] = float("nan")
        return page

    monkeypatch.setattr(PagePool, "allocate", poisoning_allocate)
    docs = [ids(20 + i, 45) for i in range(4)]
    rounds = [[d + ids(30 + i, 6)] for i, d in enumerate(docs)] + [[docs[0] + ids(40, 3)], [docs[3] + ids(41, 9)],
                                                                   [docs[1] + ids(42, 2), docs[2] + ids(43, 5)]]
    cached = []
    for prompts in rounds:
        outs = on.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        want = off.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        assert [o.token_ids for o in outs] == [w.token_ids for w in want]
        cached.append([o.num_cached_tokens for o in outs])
        assert not any(torch.isnan(torch.tensor(o.token_ids, dtype=torch.float)).any() for o in outs)
        _poison_free_pages(on)
    stats = on.stats()
    assert stats.prefix_cache_evictions > 0 and stats.prefix_cache_hits > 0 and off.stats().prefix_cache_evictions == 0
    assert on.stats().kv_pages_free["global"] == 8
    # 8 pages in all: docs 0..2 are evicted by the time they come back; doc 3 keeps its first two
    # pages (its third one holds the first question's tokens)
    assert cached == [[0], [0], [0], [0], [0], [32], [0, 0]], cached


def test_refcounts_under_abort(llama):
    llm = LLM(llama, max_num_batched_tokens=16)
    doc = ids(50, 48)
    ref = LLM(llama, prefix_caching=False).generate(prompt_token_ids=[doc + [5, 6]], sampling_params=GREEDY)[0]
    llm.generate(prompt_token_ids=[doc + [9]], sampling_params=GREEDY)
    # aborted mid-prefill (its first chunk starts at the cached 48 tokens), and mid-decode
    req = llm.core.add_request(None, doc + ids(51, 40), GREEDY)
    llm.core.step()
    assert req.seq.num_cached_tokens == 48 and 48 < req.seq.num_computed_tokens < 89
    other = llm.core.add_request(None, doc + [5, 6], GREEDY)
    for _ in range(3):
        llm.core.step()
    llm.core.abort(req)
    while not other.seq.is_finished:
        llm.core.step()
    assert llm.core.output(other).token_ids == ref.token_ids
    stream = llm.generate_stream(prompt_token_ids=doc + [7], sampling_params=GREEDY)
    assert next(stream).num_cached_tokens == 48
    stream.close()  # the client left after its first token
    kv = llm.runner.kv
    for g, spec in kv.groups.items():
        assert kv.num_free_pages(g) == spec.num_pages - 1 and kv.num_cached_pages(g) > 0
        assert kv.held_pages(g) == {}
    assert llm.stats().kv_pages_used == {g: 0 for g in kv.groups}


def test_cached_pages_cause_no_preemption(llama):
    """Cached pages are free for the scheduler: with the cache full of other prompts' pages, a load
    that fits without a cache runs without preemption and gives the same tokens."""
    small = dict(max_num_batched_tokens=32, kv_cache_memory_bytes=17 * 16 * 256 * 3, max_num_seqs=2)
    on, off = LLM(llama, **small), LLM(llama, prefix_caching=False, **small)
    for i in range(6):
        on.generate(prompt_token_ids=[ids(60 + i, 40)], sampling_params=GREEDY)
    assert on.stats().kv_pages_cached["global"] >= 12
    assert_cache_costs_no_preemption(on, off, [ids(70, 60), ids(71, 58)])


def assert_cache_costs_no_preemption(on, off, load: list[list[int]]) -> None:
    """A load that fits without preemption with the cache off (``off``) runs without preemption
    and with the same tokens with a full cache (``on``): the cached pages were evicted first."""
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    got = on.generate(prompt_token_ids=load, sampling_params=sp)
    want = off.generate(prompt_token_ids=load, sampling_params=sp)
    assert [o.token_ids for o in got] == [w.token_ids for w in want]
    assert off.scheduler.num_preemptions == 0 and on.scheduler.num_preemptions == 0
    assert on.stats().prefix_cache_evictions > 0


def test_token_drop_turned_on_at_runtime_forgets_the_cache(llama):
    """Requests running when token drop turns on may hold shared pages and would drop over them:
    prefix caching goes off and forgets its pages (a token-drop engine loaded as such keeps it for
    prompts that never drop: tests/test_prefix_caching_sparse.py)."""
    llm = LLM(llama)
    llm.generate(prompt_token_ids=[ids(80, 40)], sampling_params=GREEDY)
    assert llm.stats().kv_pages_cached == {"global": 2}
    llm.runner.set_transform("token_drop", LLM(llama, token_drop=True).engine.config.plan.knobs_of("token_drop"))  # turned on at runtime
    assert not llm.core.prefix_caching and llm.stats().kv_pages_cached == {"global": 0}
    assert llm.generate(prompt_token_ids=[ids(80, 40)], sampling_params=GREEDY)[0].num_cached_tokens == 0


def test_http_usage_reports_cached_tokens(llama):
    with running_server(LLM(llama)) as server:
        body = {"prompt": ids(90, 40), "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        first = json.loads(post(server, body)[1])["usage"]
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        second = json.loads(post(server, body)[1])
        assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
        assert second["choices"][0]["token_ids"] == json.loads(post(server, {**body, "prompt": body["prompt"]})[1])[
            "choices"][0]["token_ids"]
        status, data = post(server, {**body, "stream": True, "stream_options": {"include_usage": True}})
        last = json.loads([b for b in data.split(b"\n\n") if b.startswith(b"data: {")][-1][6:])
        assert status == 200 and last["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
        metrics = request(server, "GET", "/metrics")[1].decode()
        hits = [line for line in metrics.splitlines() if line.startswith("infhip_prefix_cache_hits_total")]
        assert hits and float(hits[0].split()[-1]) >= 96
        assert 'infhip_kv_pages_cached{group="global"}' in metrics


def test_preempted_request_reuses_its_own_pages(llama):
    """A preempted request comes back to its own cached pages (prompt and answer so far: pages
    written by decode steps included) and still gives the tokens of an uncached run."""
    small = dict(max_num_batched_tokens=32, kv_cache_memory_bytes=9 * 3 * 4096, max_num_seqs=3)
    on, off = LLM(llama, **small), LLM(llama, prefix_caching=False, **small)
    prompts = [ids(100 + i, 40) for i in range(2)]
    sp = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    got = on.generate(prompt_token_ids=prompts, sampling_params=sp)
    want = off.generate(prompt_token_ids=prompts, sampling_params=sp)
    assert [o.token_ids for o in got] == [w.token_ids for w in want]
    assert on.scheduler.num_preemptions > 0 and off.scheduler.num_preemptions > 0
    # it came back to what the running one left of its pages (freed last page first, so its start)
    assert on.stats().prefix_cache_hits > 0 and on.stats().prefix_cache_queries > 80
    assert [o.num_cached_tokens for o in got] == [0, 0]  # the first admission's
