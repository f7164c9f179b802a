"""Prefix caching beyond dense plans (issue 24; docs/design/prefix_caching.md, "Exactness per
plan"), on tiny float32 CPU engines:

* InfiniteHiP (3k knobs scaled down, sparse from 30 tokens; fp8 KV; Gemma-3 hybrid): a cached
  prefix that ends on a prefill-chunk boundary gives the logits and greedy tokens of no cache;
  one that does not equals prefilling the prefix as its own chunk sequence first (an uncached run
  forced to end a chunk there), and differs from the plain uncached run; the prefix is a multiple
  of lcm(page_size, block_q); pages that sparse decode filled are never reused; within one batch;
* offloaded KV: the document's pages are reused from pinned host memory (and the GPU), equal to
  no cache, with every page that is neither held nor cached poisoned, and under host-pool
  eviction (evicted host pages poisoned); refcounts under abort;
* token drop: only prompts that never drop take part (a prefix's kept positions depend on the
  suffix); they reuse as on a dense engine.

Runs the plugins' torch references (TRITON_INTERPRET unset), except one interpreted case."""

from __future__ import annotations

import json

import pytest
import torch

import infhip.runtime.offload.policy as offload_policy
from infhip import LLM, SamplingParams
from infhip.eval.common import record_kept_positions, set_forced_retention
from infhip.runtime.prefix_cache import PagePool
from infhip.runtime.serving.metrics import ServerMetrics

from .test_infinitehip_runtime import LOW, TINY
from .test_prefix_caching import assert_cache_costs_no_preemption

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
DYNAMIC = dict(LOW, rope_off_in_trained_window=False)  # RoPE re-rotated in every sparse step
STATELESS = dict(LOW, refresh_intervals=[1, 1, 1])  # decode recomputes every stage: no refresh clock
THRESHOLD_90 = {"dense_threshold": 90}  # a chunk ending before 90 runs dense, one ending at or past it sparse
BLOCK32 = dict(TINY, n_stream=32, stages=[(32, 4, 32), (32, 2, 16), (32, 1, 8)])  # a build knob
MiB = 1 << 20


@pytest.fixture(scope="module")
def engines(tiny_engine):
    ih = dict(preset="3k", infinitehip_overrides=TINY, max_seq_len=200, max_batch_size=4)
    return {"3k": tiny_engine("llama", **ih),
            "3k-fp8": tiny_engine("llama", kv_dtype="fp8", **ih),
            "gemma-3k": tiny_engine("gemma3", **ih),
            "3k-b32": tiny_engine("llama", **dict(ih, infinitehip_overrides=BLOCK32)),
            # the interpreted case's: 2 layers (special layer 0 and one regular, every kernel path of 3)
            "3k-2-layers": tiny_engine("llama", hf=dict(num_hidden_layers=2), **ih)}


@pytest.fixture(autouse=True)
def references(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 290, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def ask(llm: LLM, prompt: list[int], params=GREEDY, chunk_ends=()) -> tuple[list[int], torch.Tensor, int]:
    """One request alone, step by step: (tokens, logits of every sampled token [n, V], cached
    tokens). chunk_ends: positions where a prefill chunk must end (the scheduler's budget is cut
    for the step that reaches one): an uncached run "with a chunk boundary at c"."""
    sched, budget = llm.scheduler, llm.scheduler.max_num_batched_tokens
    req = llm.core.add_request(None, prompt, params)
    seq, logits = req.seq, []
    real = llm.runner.execute

    def execute(out):
        got = real(out)
        if out.chunks[0].needs_logits:
            logits.append(got[0].clone())
        return got
    llm.runner.execute = execute
    try:
        while not seq.is_finished:
            done = seq.num_computed_tokens
            cut = [e - done for e in chunk_ends if e > done]
            sched.max_num_batched_tokens = min([budget] + cut)
            llm.core.step()
    finally:
        llm.runner.execute, sched.max_num_batched_tokens = real, budget
    llm.core.abort(req)  # finished: the core forgets it
    return list(seq.output_token_ids), torch.stack(logits), seq.num_cached_tokens


def same(a, b) -> bool:
    return a[0] == b[0] and torch.allclose(a[1], b[1], rtol=1e-5, atol=1e-5)


def pair(engine, overrides, budget=32, **kw) -> tuple[LLM, LLM]:
    on = LLM(engine, max_num_batched_tokens=budget, infinitehip_overrides=overrides, **kw)
    off = LLM(engine, max_num_batched_tokens=budget, infinitehip_overrides=overrides, prefix_caching=False, **kw)
    assert on.core.prefix_caching and not off.core.prefix_caching
    return on, off


def sparse_prefills(llm: LLM) -> int:
    """Steps so far whose plan had sparse prefill chunks (the InfiniteHiP backend's read-out,
    through JSON: the view must survive it)."""
    return json.loads(json.dumps(llm.debug_view()))["backends"]["infinitehip"]["steps"]["sparse_prefill"]


# ---- InfiniteHiP ------------------------------------------------------------------------------
@pytest.mark.parametrize("engine,overrides", [("3k", LOW), ("3k", DYNAMIC), ("3k-fp8", LOW), ("gemma-3k", LOW)])
def test_prefix_on_a_chunk_boundary_equals_no_cache(engines, engine, overrides):
    """Budget 32: the document's 96 tokens are three whole chunks, in the request that computed
    them and in the uncached run; the follow-up's first chunk starts at 96 in both."""
    on, off = pair(engines[engine], overrides)
    doc = ids(1, 96)
    before = sparse_prefills(on)
    for llm in (on, off):  # the same first request in both: the refresh clock stays in step
        ask(llm, doc + ids(2, 10))
    assert sparse_prefills(on) - before >= 3, "the document's chunks ran sparse"
    got, want = ask(on, doc + ids(3, 13)), ask(off, doc + ids(3, 13))
    assert got[2] == 96 and want[2] == 0
    assert same(got, want), (got[0], want[0], (got[1] - want[1]).abs().max())


def test_prefix_on_a_chunk_boundary_under_the_interpreter(engines, monkeypatch):
    """The Triton kernels (interpreted) over a reused prefix: one 32-token chunk cached."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    on, off = pair(engines["3k-2-layers"], LOW)
    doc, short = ids(4, 32), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    ask(on, doc + ids(5, 6), short)  # (its one decode step recomputes every stage: no clock to keep in step)
    got, want = ask(on, doc + ids(6, 9), short), ask(off, doc + ids(6, 9), short)
    assert got[2] == 32 and same(got, want)


@pytest.mark.parametrize("overrides", [LOW, DYNAMIC, THRESHOLD_90])
def test_prefix_off_the_chunk_boundary(engines, overrides):
    """The document (80 tokens) ends inside a chunk of the uncached run ([64, 96), budget 32).

    (a) The cache filled by a longer first request (whose chunk [64, 96) straddles 80): its pages
    [64, 80) were computed in query blocks [64, 72), [72, 80), which read only keys before their
    end, in the mode of a chunk ending at 96 — as in the uncached follow-up: equal to no cache.
    (b) The cache filled by the document as its own request (chunks end at 64, 80): equal to the
    uncached follow-up forced to end a chunk at 80. With dense_threshold 90 that chunk runs dense
    where the plain uncached run's [64, 96) runs sparse: (b) then differs from no cache."""
    doc, follow = ids(7, 80), ids(7, 80) + ids(9, 30)
    on, off = pair(engines["3k"], overrides)
    for llm in (on, off):
        ask(llm, doc + ids(8, 20))
    got, plain = ask(on, follow), ask(off, follow)
    assert got[2] == 80 and same(got, plain)
    on, off = pair(engines["3k"], overrides)
    ask(on, doc, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    ask(off, doc, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    got, forced = ask(on, follow), ask(off, follow, chunk_ends=[80])
    assert got[2] == 80 and same(got, forced)
    if overrides is THRESHOLD_90:
        assert not torch.allclose(got[1][0], plain[1][0], rtol=1e-5, atol=1e-5), "the mode of [64, 80) matters"


def test_reused_prefix_is_a_multiple_of_block_q(engines):
    """block_q 32 over 16-token pages: of a document of five cached pages (80 tokens) the
    follow-up reuses 64, so its first chunk starts on the query-block grid — equal to no cache,
    whose chunk boundary (budget 32) is at 64 too."""
    on, off = pair(engines["3k-b32"], LOW)
    assert on.runner.kv.granule_pages == 2
    doc = ids(10, 80)
    for llm in (on, off):
        ask(llm, doc + ids(11, 20))
    got, want = ask(on, doc + ids(12, 9)), ask(off, doc + ids(12, 9))
    assert got[2] == 64 and same(got, want)


def test_pages_filled_by_sparse_decode_are_not_reused(engines):
    """A second turn (first prompt + its answer + a new question) reuses the first prompt's
    prefill pages only: page [96, 112) was completed by sparse decode steps, which compute K/V
    otherwise than a prefill of the same tokens."""
    on, off = pair(engines["3k"], LOW)
    first = ids(13, 100)
    answers = [ask(llm, first)[0] for llm in (on, off)]
    assert answers[0] == answers[1]
    second = first + answers[0] + ids(14, 20)  # 128 tokens: pages 0..7 computed, 6 by prefill
    got, want = ask(on, second), ask(off, second)
    assert got[2] == 96 and same(got, want)


def test_within_one_batch(engines):
    """Two requests over one document in one generate() call: the second is admitted once the
    first has named the document's pages and starts at 96 (its first chunk shares a step with the
    first's last one). Decode recomputes every stage (no refresh clock), so each equals its
    uncached run alone."""
    on, off = pair(engines["3k"], STATELESS)
    doc = ids(15, 96)
    prompts = [doc + ids(16, 10), doc + ids(17, 13)]
    outs = on.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.num_cached_tokens for o in outs] == [0, 96]
    assert [o.token_ids for o in outs] == [ask(off, p)[0] for p in prompts]


def test_runtime_knob_change_forgets_the_cache(engines):
    on, _ = pair(engines["3k"], LOW)
    doc = ids(18, 64)
    ask(on, doc + [5])
    assert on.stats().kv_pages_cached["global"] > 0
    plan = on.engine.config.plan.at_load({"infinitehip": dict(refresh_intervals=(8, 4, 2))})
    on.runner.set_backend("infinitehip", plan.knobs_of("infinitehip"))
    assert on.stats().kv_pages_cached["global"] == 0 and ask(on, doc + [6])[2] == 0


# ---- offloaded KV -----------------------------------------------------------------------------
# RoPE on in the tiny window, so pages move from the sparse threshold (30) on, a page at a time.
PAST = dict(LOW, rope_off_in_trained_window=False)


@pytest.fixture
def small_batches(monkeypatch):
    monkeypatch.setattr(offload_policy, "OFFLOAD_BATCH_TOKENS", 16)


def host_twins(llm):
    return [layer.self_attn.kv for layer in llm.engine.model.layers if layer.self_attn.kv.host is not None]


def poison_unused_pages(llm) -> None:
    """NaN into every GPU and host page that no sequence holds and the cache does not keep."""
    kv = llm.runner.kv
    gpu = kv.free_page_ids("global")
    host = [-e - 1 for e in kv.free_page_ids("global", host=True)]  # host entry e is twin page -1 - e
    for cache in host_twins(llm):
        for t, pages in ((cache.k, gpu), (cache.v, gpu), (cache.host.k, host), (cache.host.v, host)):
            if pages:
                t[pages] = float("nan")


@pytest.mark.parametrize("engine", ["3k", "3k-fp8"])
def test_document_cached_in_host_memory(engines, small_batches, engine):
    on, off = pair(engines[engine], PAST, kv_offload_bytes=4 * MiB)
    doc = ids(20, 96)
    for llm in (on, off):
        ask(llm, doc + ids(21, 10))
    kv = on.runner.kv
    cached_host = on.stats().host_pages_cached["global"]
    assert cached_host >= 3, "the document's middle pages are cached on the host"
    metrics = ServerMetrics(on.core.info())
    metrics.sample(on.stats())
    assert f'infhip_host_pages_cached{{group="global"}} {float(cached_host)}' in metrics.render().decode()
    poison_unused_pages(on)
    shared = []
    real = kv.share
    kv.share = lambda seq_id, tokens: shared.append(real(seq_id, tokens)) or (
        shared.append(list(kv.block_table(seq_id, "global"))) or shared[-2])
    got, want = ask(on, doc + ids(22, 13)), ask(off, doc + ids(22, 13))
    kv.share = real
    assert shared[0] == 96 and any(e < 0 for e in shared[1]), "the follow-up started on host pages"
    assert got[2] == 96 and same(got, want)
    for g in kv.groups:
        assert kv.held_pages(g) == {}, g  # GPU and host pages


def test_host_cache_eviction_with_poisoned_pages(engines, small_batches, monkeypatch):
    """A host pool of 8 pages: documents evict each other's cached host pages (each evicted page
    is NaN until its new owner's copy lands); every answer equals the uncached one."""
    host_page_bytes = 16 * 2 * (2 * 16 * 4) * 3  # page x (K, V) x Hkv x D x float32 x 3 layers
    on, off = pair(engines["3k"], PAST, kv_offload_bytes=8 * host_page_bytes)
    assert on.runner.kv.groups["global"].offload.host_pages == 8
    twins = host_twins(on)
    evict = PagePool.allocate

    def poisoning_allocate(pool):  # only `on` evicts: `off` names no page
        before = pool.num_evictions
        page = evict(pool)
        if pool.host and pool.group == "global" and pool.num_evictions != before:
            for cache in twins:
                cache.host.k[page - 1] = float("nan")
                cache.host.v[page - 1] = float("nan")
        return page
    monkeypatch.setattr(PagePool, "allocate", poisoning_allocate)
    docs = [ids(30 + i, 96) for i in range(2)]
    order = [0, 1, 0, 1, 1]
    cached = []
    for i, d in enumerate(order):
        prompt = docs[d] + ids(40 + i, 6)
        got, want = ask(on, prompt), ask(off, prompt)
        assert got[0] == want[0], i
        assert torch.isfinite(got[1]).all()
        cached.append(got[2])
    assert on.stats().prefix_cache_evictions > 0 and off.stats().prefix_cache_evictions == 0
    assert cached[0] == cached[1] == 0 and cached[-1] == 96 and min(cached[2:4]) < 96, cached


def test_abort_releases_host_pages(engines, small_batches):
    on, _ = pair(engines["3k"], PAST, kv_offload_bytes=4 * MiB)
    doc = ids(50, 96)
    ask(on, doc + [1])
    req = on.core.add_request(None, doc + ids(51, 60), GREEDY)
    for _ in range(2):
        on.core.step()
    assert req.seq.num_cached_tokens == 96 and req.seq.num_computed_tokens > 96
    assert any(e < 0 for e in on.runner.kv.block_table(req.seq.seq_id, "global"))
    on.core.abort(req)
    kv = on.runner.kv
    assert on.stats().host_pages_used == {"global": 0}
    for g in kv.groups:
        assert kv.held_pages(g) == {}, g  # GPU and host pages
    assert ask(on, doc + [2])[2] == 96


@pytest.mark.parametrize("offload", [False, True])
def test_cached_pages_cause_no_preemption(engines, small_batches, offload):
    """Memory accounting: cached GPU pages (and cached host pages) count as free, a new page
    evicts them first. With both pools full of earlier prompts' pages, a load that fits without a
    cache runs without preemption and gives the uncached tokens."""
    page = 16 * 2 * 16 * 4 * 2  # bytes of one page of one layer (K and V, float32)
    kw = dict(kv_cache_memory_bytes=17 * page * 3, max_num_seqs=2)
    if offload:
        kw["kv_offload_bytes"] = 12 * page * 3
    on, off = pair(engines["3k"], PAST if offload else LOW, **kw)
    for i in range(6):  # in both: the sparse refresh clock stays in step
        for llm in (on, off):
            ask(llm, ids(70 + i, 40))
    kv = on.runner.kv
    assert kv.num_cached_pages("global") >= 8
    if offload:
        assert kv.num_cached_host_pages("global") >= 6
    assert_cache_costs_no_preemption(on, off, [ids(80, 60), ids(81, 58)])


# ---- token drop -------------------------------------------------------------------------------
# drop_layers "every": all 3 layers of the tiny Llama (what "auto" gave before 2026-12-05; the
# deeper default skips layer 0)
DROP = dict(obs_window=8, block_size=8, num_sink=8, min_prompt_len=0, spare_anchors=0, drop_layers="every")


@pytest.fixture(scope="module")
def token_drop_engine(tiny_engine):
    return tiny_engine("llama", max_seq_len=256, max_batch_size=2)


def test_token_drop_history_depends_on_the_suffix(token_drop_engine):
    """Why a request that drops never shares or names pages: the blocks a chunk keeps are chosen
    by the observation window at the chunk's end (here the prompt's: one chunk), so two prompts
    with the same first 160 tokens keep different positions of them (their compacted pages differ)."""
    llm = set_forced_retention(LLM(token_drop_engine, token_drop=DROP), 0.3)  # keep the top 30 % of blocks by importance
    kept_positions = record_kept_positions(llm)
    doc = ids(60, 160)
    for i in range(2):
        out = llm.generate(prompt_token_ids=[doc + ids(61 + i, 40)], sampling_params=GREEDY)[0]
        assert out.num_cached_tokens == 0
    kept = list(kept_positions.values())  # per sequence: {anchor: [positions]}
    assert len(kept) == 2
    prefix = [{layer: [p for p in torch.cat(v).tolist() if p < 160] for layer, v in k.items()} for k in kept]
    assert any(len(p) < 160 for p in prefix[0].values()), "the prefix itself was dropped from"
    assert prefix[0] != prefix[1]
    assert llm.stats().kv_pages_cached == {"global": 0}, "pages of a dropping request are never named"


def test_token_drop_engine_reuses_prompts_that_never_drop(token_drop_engine):
    """min_prompt_len 100: prompts shorter than that never drop and share pages as on a dense
    engine (same tokens as no cache); longer ones drop, and neither take nor name cached pages."""
    knobs = dict(DROP, min_prompt_len=100)
    on = set_forced_retention(LLM(token_drop_engine, token_drop=knobs, max_num_batched_tokens=32), 0.3)
    off = set_forced_retention(LLM(token_drop_engine, token_drop=knobs, max_num_batched_tokens=32, prefix_caching=False), 0.3)
    assert on.core.prefix_caching
    doc = ids(62, 160)
    prompts = [doc[:64] + ids(63, 6), doc[:64] + ids(64, 9),  # short: reuse
               doc + ids(65, 20), doc + ids(66, 20),  # long: drop, no reuse
               doc[:64] + ids(67, 3)]  # short again: reuses the short ones' pages, not the long ones'
    got = [on.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0] for p in prompts]
    want = [off.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0] for p in prompts]
    assert [o.token_ids for o in got] == [w.token_ids for w in want]
    assert [o.num_cached_tokens for o in got] == [0, 64, 0, 0, 64]
    retention = on.debug_view()["transforms"]["token_drop"]["retention"]
    assert len(retention) == 2 and all(
        kept < total for r in retention.values() for kept, total in r.values()), \
        "the long prompts dropped"
