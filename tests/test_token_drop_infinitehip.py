"""UniPrefill token drop composed with InfiniteHiP (infhip/methods/token_drop/runtime/step.py, "With InfiniteHiP
layers"): token-drop prefill, then sparse prefill/decode over each layer's compacted KV.

The exactness check uses covering InfiniteHiP stages (every candidate kept, refreshed every
step): sparse attention over a layer's keys then equals dense attention over them, so the
composed engine must give the dense engine's tokens under the same drops, token for token —
which fails if the sparse plugins saw the uncompacted lengths (they would read slots the layer
never wrote)."""

from __future__ import annotations

import json

import pytest

from infhip import LLM, SamplingParams
from infhip.methods.infinitehip import infinitehip_config
from infhip.eval.common import set_forced_retention
from infhip.methods.infinitehip.runtime.planner import SparsePlanner
from tests._graph_sim import simulate_graphs
from infhip.eval.token_drop_reference import token_drop_view
from tests.test_infinitehip_runtime import COVER, TINY
from tests.test_infinitehip_runtime import calls  # noqa: F401 (fixture: sparse attention launch counts)
from tests.test_infinitehip_runtime_schedule import seq
from tests.test_token_drop_runtime import TINY as TINY_DROP
from tests.test_token_drop_runtime import prompt

# drop at every full layer of the tiny model (the deeper default rule leaves it one or none)
DROP, RHO = dict(TINY_DROP, drop_layers="every"), 0.4  # a forced retention of 40 % (set_forced_retention)
LOW = {"dense_threshold": 30}
PROMPTS = [prompt(11, 150), prompt(12, 97), prompt(13, 181)]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_engine):
    kw = dict(max_seq_len=400, max_batch_size=4)
    return {"dense": tiny_engine(**kw), "cover": tiny_engine(preset="3k", infinitehip_overrides=COVER, **kw),
            "3k": tiny_engine(preset="3k", infinitehip_overrides=TINY, **kw)}


def run(engine, overrides=None, budget=64, prompts=PROMPTS, params=GREEDY):
    llm = set_forced_retention(LLM(engine, max_num_batched_tokens=budget, infinitehip_overrides=overrides,
                                   token_drop=DROP), RHO)
    out = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    return out, llm


@pytest.mark.parametrize("budget", [64, 512])  # chunked prefill mixing drops and decodes; one pass each
def test_covering_sparse_over_compacted_kv_equals_dense(engines, calls, budget):
    dense, dense_llm = run(engines["dense"], budget=budget)
    assert token_drop_view(dense_llm)["retention"]  # tokens were dropped
    composed, llm = run(engines["cover"], LOW, budget=budget)
    assert calls["decode"] > 0
    assert composed == dense
    assert token_drop_view(llm)["retention"] == token_drop_view(dense_llm)["retention"]  # the same drops


@pytest.mark.parametrize("engine", ["dense", "cover"])
def test_decode_graphs_with_drop_histories_equal_eager(engines, monkeypatch, engine):
    """The CUDA-graph path without CUDA (tests/_graph_sim.py): decode steps of requests with a
    drop history replay the graph of the token-drop transform's per-layer KV (lengths and slots
    computed from the staged shifts; with InfiniteHiP rows too) and give the eager tokens. The
    plugins' torch references run (staging is the point; the GPU suite replays real graphs)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    overrides = LOW if engine == "cover" else None
    eager, _ = run(engines[engine], overrides)
    llm = set_forced_retention(LLM(engines[engine], max_num_batched_tokens=64, infinitehip_overrides=overrides,
                                   token_drop=DROP), RHO)
    keys, planned = simulate_graphs(llm, monkeypatch)
    assert [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)] == eager
    shifted = [key for key in keys if key.kv_shift == "token_drop"]
    assert shifted and all(key in planned for key in keys)
    if engine == "cover":
        assert any(key.of("infinitehip") is not None for key in shifted)
    # the engine's read-out of its graphs says the same (EngineCore.debug_view, JSON-able)
    captured = json.loads(json.dumps(llm.debug_view()["graphs"]))["captured"]
    assert {(g["kv_shift"], g["backends"].get("infinitehip") is not None) for g in captured} == {
        (key.kv_shift, key.of("infinitehip") is not None) for key in keys}


def test_pruning_presets_run_after_drops(engines, calls):
    out, llm = run(engines["3k"], LOW)
    assert all(len(t) == GREEDY.max_tokens for t in out)
    assert token_drop_view(llm)["retention"] and calls["decode"] > 0


def test_requests_that_may_pass_the_trained_window_do_not_drop(engines, monkeypatch):
    """Tiny model: trained window 256. 200 + 57 tokens could end past it (dynamic RoPE over a
    compacted cache is not exact): no drop; 200 + 10 drops. (A scheduling rule: the plugins'
    torch references run, not the interpreter.)"""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ids = prompt(14, 200)
    _, llm = run(engines["3k"], LOW, prompts=[ids], params=SamplingParams(max_tokens=57, ignore_eos=True))
    assert not token_drop_view(llm)["retention"]
    _, llm = run(engines["3k"], LOW, prompts=[ids], params=SamplingParams(max_tokens=10, ignore_eos=True))
    assert token_drop_view(llm)["retention"]


def test_a_step_without_sparse_attention_invalidates_cached_masks():
    cfg = infinitehip_config("3k", dict(n_sink=4, n_stream=8, stages=[(8, 4, 32), (8, 2, 16), (8, 1, 8)],
                                        special_final_k=16, dense_threshold=50, stagger_refresh=False))
    planner = SparsePlanner(cfg, max_slots=2, trained_window=100)
    a = seq(0, 60)
    assert planner.plan([a], [60], 1).decode_first_stage == [(0,)]
    assert planner.plan([a], [61], 1).decode_first_stage != [(0,)]
    planner.skip([a])  # e.g. a step that dropped tokens ran no sparse attention
    assert planner.plan([a], [63], 1).decode_first_stage == [(0,)]
