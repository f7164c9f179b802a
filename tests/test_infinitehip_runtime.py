"""InfiniteHiP in the runtime, on tiny CPU engines: every preset generates; above the context
dense_threshold keeps the dense result token for token; below it the sparse path runs, and
equals dense when the selected sets cover the whole context; sliding layers stay dense.

Most tests run the plugins' torch references (TRITON_INTERPRET unset for them, fast); a few run
the Triton launchers under the interpreter, on 2-layer engines (fixture two_layer)."""

from __future__ import annotations

import json
import shutil

import pytest

import infhip.methods.infinitehip.runtime.layer as sa
import infhip.methods.infinitehip.runtime.planner as sparse_plan
from infhip.runtime import kv_budget
from infhip import LLM, SamplingParams
from infhip.config import EngineConfig
from tests._graph_sim import simulate_graphs

# Test-only knobs: n_sink 4, n_stream 8, stages (8, 4, 32) -> (8, 2, 16) -> (8, 1, 8).
TINY = dict(n_sink=4, n_stream=8, stages=[(8, 4, 32), (8, 2, 16), (8, 1, 8)], special_layers=[0],
            special_final_k=16)
TINY_5K = dict(TINY, stages=[(8, 8, 32), (8, 4, 16), (8, 2, 8)])
# Stages that keep every candidate of these contexts; with refresh every step = dense attention.
COVER = dict(TINY, stages=[(8, 4, 256), (8, 2, 256), (8, 1, 256)], special_final_k=256, refresh_intervals=[1, 1, 1])
NEVER = {"dense_threshold": 10**6}
LOW = {"dense_threshold": 30}

PROMPTS = [[(7 * i + 3 * j) % 290 + 3 for j in range(n)] for i, n in enumerate((90, 41, 120))]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_engine):
    kw = dict(max_seq_len=200, max_batch_size=4)
    e = {"dense": tiny_engine("llama", **kw),
         "gemma-dense": tiny_engine("gemma3", **kw),
         "gemma-3k": tiny_engine("gemma3", preset="3k", infinitehip_overrides=TINY, **kw),
         "cover": tiny_engine("llama", preset="3k", infinitehip_overrides=COVER, **kw)}
    for preset in ("3k", "3k-fast", "3k-flash", "5k"):
        e[preset] = tiny_engine("llama", preset=preset, infinitehip_overrides=TINY_5K if preset == "5k" else TINY, **kw)
    fp8 = dict(kw, kv_dtype="fp8")  # the same weights over an fp8 KV cache (plugins/kv_quant.py)
    e["dense-fp8"] = tiny_engine("llama", **fp8)
    e["cover-fp8"] = tiny_engine("llama", preset="3k", infinitehip_overrides=COVER, **fp8)
    e["3k-fp8"] = tiny_engine("llama", preset="3k", infinitehip_overrides=TINY, **fp8)
    return e


@pytest.fixture(scope="module")
def two_layer(tiny_engine):
    """The interpreter tests' engines: the tiny Llama cut to 2 layers (the special layer 0 and one
    regular InfiniteHiP layer: every kernel path of 3 layers, a third less interpreter time)."""
    kw = dict(hf=dict(num_hidden_layers=2), max_seq_len=200, max_batch_size=4)
    e = {"dense": tiny_engine("llama", **kw), "dense-fp8": tiny_engine("llama", kv_dtype="fp8", **kw)}
    for name, knobs in (("3k", TINY), ("cover", COVER)):
        e[name] = tiny_engine("llama", preset="3k", infinitehip_overrides=knobs, **kw)
        e[name + "-fp8"] = tiny_engine("llama", preset="3k", infinitehip_overrides=knobs, kv_dtype="fp8", **kw)
    return e


@pytest.fixture
def calls(monkeypatch):
    """Count the sparse attention launches (the plugins' torch references run: no interpreter)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    n = {"decode": 0, "prefill": 0}
    for name, key in (("sparse_decode_attention", "decode"), ("sparse_prefill_attention", "prefill")):
        real = getattr(sa, name)

        def counted(*a, _real=real, _key=key, **k):
            n[_key] += 1
            return _real(*a, **k)
        monkeypatch.setattr(sa, name, counted)
    return n


def generate(engine, overrides=None, prompts=PROMPTS, params=GREEDY, budget=64):
    llm = LLM(engine, max_num_batched_tokens=budget, infinitehip_overrides=overrides)
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


@pytest.fixture(scope="module")
def dense_tokens(engines):
    return generate(engines["dense"])


@pytest.mark.parametrize("preset", ["3k", "3k-fast", "3k-flash", "5k"])
def test_presets_generate_and_match_dense_above_context(engines, dense_tokens, calls, preset):
    assert generate(engines[preset], NEVER) == dense_tokens  # threshold above every context
    assert calls == {"decode": 0, "prefill": 0}
    sparse = generate(engines[preset], LOW)  # chunked prefill (budget 64) + decode, sparse
    assert calls["prefill"] > 0 and calls["decode"] > 0
    assert [len(t) for t in sparse] == [GREEDY.max_tokens] * len(PROMPTS)


@pytest.mark.parametrize("chunk_score", ["max", "head_normalized"])
def test_covering_sets_equal_dense(engines, dense_tokens, calls, chunk_score):
    assert generate(engines["cover"], dict(LOW, chunk_score=chunk_score)) == dense_tokens
    assert calls["prefill"] > 0 and calls["decode"] > 0


def test_head_normalized_chunk_score_changes_the_masks(engines, calls):
    """The knob reaches the pruning stages: with real pruning (TINY knobs) the two scores pick
    different chunks somewhere in these prompts, so the greedy tokens differ."""
    raw = generate(engines["3k"], dict(LOW, chunk_score="max"))
    normalized = generate(engines["3k"], dict(LOW, chunk_score="head_normalized"))
    assert calls["decode"] > 0 and [len(t) for t in normalized] == [GREEDY.max_tokens] * len(PROMPTS)
    assert raw != normalized


def test_query_strides_reach_prefill_stages(engines, monkeypatch):
    """The runtime knob query_strides: prefill's stage i gets stride query_strides[i] (decode
    one query, no stride), covering sets stay equal to dense with any stride, and a config
    with a wrong length is refused."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    seen = []
    real = sa.pruning_stage

    def spy(*a, **k):
        seen.append((k["block_q"], k.get("query_stride", 1)))
        return real(*a, **k)
    monkeypatch.setattr(sa, "pruning_stage", spy)
    out = generate(engines["cover"], dict(LOW, query_strides=[8, 3, 1]))
    assert {s for b, s in seen if b > 1} == {8, 3, 1} and {s for b, s in seen if b == 1} == {1}
    assert out == generate(engines["dense"])
    with pytest.raises(ValueError, match="query strides"):
        LLM(engines["cover"], infinitehip_overrides={"query_strides": [4, 4]})


def test_covering_sets_equal_dense_under_interpreter(two_layer):
    """The Triton launchers (interpreted) in the runtime: one short request, sparse from the start."""
    prompts, params = [PROMPTS[1][:33]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert generate(two_layer["cover"], LOW, prompts, params) == generate(two_layer["dense"], None, prompts, params)


def test_raw_keys_in_prefill_under_interpreter(two_layer, monkeypatch):
    """Dynamic RoPE with >= RAW_KEYS_MIN_BLOCKS query blocks in a step: the interpreted kernels
    prune from keys un-rotated once per layer (unrotate_keys called), and generate the same
    tokens as re-rotating every loaded key in-kernel (threshold raised: no raw keys)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(sparse_plan, "RAW_KEYS_MIN_BLOCKS", 8)  # tiny blocks: 66 tokens are 9
    prompts, params = [PROMPTS[2][:66]], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    knobs = dict(LOW, rope_off_in_trained_window=False)
    made = []
    real = sa.unrotate_keys
    monkeypatch.setattr(sa, "unrotate_keys", lambda *a, **k: made.append(1) or real(*a, **k))
    with_raw = generate(two_layer["3k"], knobs, prompts, params)
    assert made
    monkeypatch.setattr(sparse_plan, "RAW_KEYS_MIN_BLOCKS", 10**9)
    made.clear()
    assert generate(two_layer["3k"], knobs, prompts, params) == with_raw and not made


def test_fp8_cache_covering_sets_equal_fp8_dense(engines, calls):
    """Over an fp8 KV cache the sparse path (torch references) reads the same dequantized keys
    and values as the dense one: covering sets give the fp8 dense engine's tokens."""
    assert generate(engines["cover-fp8"], LOW) == generate(engines["dense-fp8"])
    assert calls["prefill"] > 0 and calls["decode"] > 0


def test_fp8_cache_kernels_equal_references_in_the_runtime(two_layer, monkeypatch):
    """The Triton launchers (interpreted) over an fp8 cache with real pruning, dynamic RoPE, raw
    keys (a 66-token prefill has >= RAW_KEYS_MIN_BLOCKS blocks) and the rotated key bank give the
    torch references' tokens; covering sets give fp8 dense's."""
    prompts, params = [PROMPTS[2][:66]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    monkeypatch.setattr(sparse_plan, "RAW_KEYS_MIN_BLOCKS", 8)  # tiny blocks: 66 tokens are 9
    knobs = dict(LOW, rope_off_in_trained_window=False)
    made, banked = [], []
    real, real_bank = sa.unrotate_keys, sa.write_key_bank
    monkeypatch.setattr(sa, "unrotate_keys", lambda *a, **k: made.append(1) or real(*a, **k))
    monkeypatch.setattr(sa, "write_key_bank", lambda *a, **k: banked.append(1) or real_bank(*a, **k))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels = generate(two_layer["3k-fp8"], knobs, prompts, params)
    assert made and banked
    dense = generate(two_layer["dense-fp8"], None, prompts, params)
    assert generate(two_layer["cover-fp8"], LOW, prompts, params) == dense
    monkeypatch.delenv("TRITON_INTERPRET")
    assert generate(two_layer["3k-fp8"], knobs, prompts, params) == kernels


def test_dynamic_rope_runs(engines, calls):
    out = generate(engines["3k"], dict(LOW, rope_off_in_trained_window=False), PROMPTS[:1])
    assert len(out[0]) == GREEDY.max_tokens and calls["decode"] > 0


def test_sparse_graph_inputs_read_eagerly_equal_eager_steps(engines, monkeypatch):
    """The CUDA-graph path without CUDA (tests/_graph_sim.py): sparse decode steps staged for the
    graph of their refresh pattern (mask-cache slots in the backend's graph rows) and run on the
    context that graph would capture give the eager tokens; every key was planned at load. The
    plugins' torch references run (they take the graph rows the kernels take; staging is the
    point here: interpreted, both runs took ~8 CPU minutes; the kernels replay real graphs in
    test_gpu_infinitehip)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    eager = generate(engines["3k"], LOW)
    llm = LLM(engines["3k"], max_num_batched_tokens=64, infinitehip_overrides=LOW)
    keys, planned = simulate_graphs(llm, monkeypatch)
    assert [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)] == eager
    sparse = {key.of("infinitehip") for key in keys} - {None}
    assert len(sparse) >= 2 and all(key in planned for key in keys)  # several refresh patterns


def test_gemma3_sliding_layers_stay_dense(engines, calls):
    llm = LLM(engines["gemma-3k"], max_num_batched_tokens=64)
    sparse_layers = [i for i, layer in enumerate(llm.runner.model.layers) if layer.self_attn.backend_state is not None]
    assert sparse_layers == [5]  # the one full-attention layer of the tiny Gemma-3
    assert generate(engines["gemma-3k"], NEVER) == generate(engines["gemma-dense"])
    generate(engines["gemma-3k"], LOW)
    assert calls["decode"] > 0


def test_overrides_refused_on_dense_engine(engines):
    with pytest.raises(ValueError, match="no infinitehip layers"):
        LLM(engines["dense"], infinitehip_overrides={"dense_threshold": 5})


def test_plugins_dispatch_to_torch_on_cpu(monkeypatch):
    """Without TRITON_INTERPRET, CPU tensors take the torch references; same answers as the
    interpreted launchers (the same contract: shapes, PAD padding, rows written)."""
    import torch

    from infhip.plugins.infinitehip import plan_query_blocks, pruning_stage, sparse_prefill_attention
    from infhip.plugins.paged_kv import PagedKV
    g = torch.Generator().manual_seed(0)
    page, Hq, Hkv, D = 8, 4, 2, 16
    kc, vc = (torch.randn(12, page, Hkv, D, generator=g) for _ in range(2))
    tables = torch.arange(1, 12, dtype=torch.int32)[None, :]
    q = torch.randn(13, Hq, D, generator=g)
    q_start, q_lens, ends, seq = plan_query_blocks([13], [80], block_q=8)
    tables = tables[seq.long()].contiguous()
    kw = dict(n_sink=4, n_stream=8)

    def run():
        sel, n = pruning_stage(q, PagedKV(kc, vc), tables, q_start, q_lens, ends, chunk_size=4, k=16, block_q=8, **kw)
        out = torch.full_like(q, 7.0)
        sparse_prefill_attention(q, PagedKV(kc, vc), tables, q_start, q_lens, ends, sel, block_q=8, scale=0.25,
                                 out=out, **kw)
        return sel, n, out

    interpreted = run()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ref = run()
    assert torch.equal(interpreted[0], ref[0]) and torch.equal(interpreted[1], ref[1])
    torch.testing.assert_close(interpreted[2], ref[2], atol=1e-4, rtol=1e-4)


def test_key_bank_matches_rotating_every_step(two_layer, monkeypatch, reference_pruning):
    """key_bank (dynamic RoPE on from the first sparse step): the last stage's refreshes write
    the bank, the cached steps attend with it, and the tokens equal those of rotating every key
    at every step. Interpreted kernels (the bank is a kernel path; pruning by its reference);
    refresh 4 / 2 / 1 steps."""
    prompts, params = [PROMPTS[1][:33], PROMPTS[0][:40]], SamplingParams(max_tokens=6, temperature=0.0,
                                                                         ignore_eos=True)
    knobs = dict(LOW, rope_off_in_trained_window=False, refresh_intervals=[4, 2, 1])
    writes, bank_calls = [], []
    real_write, real_attn = sa.write_key_bank, sa.sparse_decode_attention

    def spy_write(*a, **k):
        writes.append(a[3].shape[0])  # rows written
        return real_write(*a, **k)

    def spy_attn(*a, **k):
        bank_calls.append(k.get("bank") is not None)
        return real_attn(*a, **k)
    monkeypatch.setattr(sa, "write_key_bank", spy_write)
    monkeypatch.setattr(sa, "sparse_decode_attention", spy_attn)
    rotating = generate(two_layer["3k"], dict(knobs, key_bank=False), prompts, params)
    assert writes == [] and bank_calls and not any(bank_calls)
    banked = generate(two_layer["3k"], dict(knobs, key_bank=True), prompts, params)
    assert writes and all(bank_calls[len(bank_calls) // 2:]), "every banked decode step reads the bank"
    assert banked == rotating
    # one bank row (key_bank_slots=1): while both requests decode, the second one's slot owns no
    # row and the steps rotate; the first request alone reads the bank again; the same tokens
    bank_calls.clear()
    short = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)]
    mixed = generate(two_layer["3k"], dict(knobs, key_bank=True, key_bank_slots=1), prompts, short)
    assert mixed == [rotating[0], rotating[1][:3]]
    assert bank_calls.count(False) >= 1 and bank_calls[-1], bank_calls


def test_key_bank_memory_is_reserved(engines):
    """The default KV budget leaves room for the banks: (slots + 1) x final k x Hkv x D per
    InfiniteHiP layer (special layers keep special_final_k), and only when a step can have
    dynamic RoPE: with rope_off_in_trained_window and every sequence inside the trained window
    the bank is never read, so none is kept."""
    past_window = {"rope_off_in_trained_window": False}
    off = LLM(engines["3k"], max_num_seqs=3, infinitehip_overrides=dict(past_window, key_bank=False)).runner
    on = LLM(engines["3k"], max_num_seqs=3, infinitehip_overrides=dict(past_window, key_bank=True)).runner
    plan = on.engine.config.plan
    cfg, ih = on.engine.config.model, plan.knobs_of("infinitehip")
    final_ks = [ih.stages_of(lp.index)[-1].k for lp in plan.layers if lp.backend == "infinitehip"]
    expected = sum((3 + 1) * k * cfg.num_kv_heads * cfg.head_dim * 4 for k in final_ks)  # float32 KV
    assert kv_budget.reserved_bytes(on.engine.config, 3, 64) - kv_budget.reserved_bytes(off.engine.config, 3, 64) == expected > 0
    banks = [layer.self_attn.backend_state.cache.bank for layer in on.model.layers if layer.self_attn.backend_state]
    assert sum(b.numel() * b.element_size() for b in banks) == expected
    # key_bank_slots below max_num_seqs bounds it: (slots + 1) rows
    few = LLM(engines["3k"], max_num_seqs=3, infinitehip_overrides=dict(past_window, key_bank_slots=1)).runner
    assert kv_budget.reserved_bytes(few.engine.config, 3, 64) - kv_budget.reserved_bytes(off.engine.config, 3, 64) == expected // 2
    banks = [layer.self_attn.backend_state.cache.bank for layer in few.model.layers if layer.self_attn.backend_state]
    assert sum(b.numel() * b.element_size() for b in banks) == expected // 2

    inside = LLM(engines["3k"], max_num_seqs=3, infinitehip_overrides={"key_bank": True}).runner
    assert inside.max_seq_len <= cfg.max_position_embeddings  # the test engine fits its window
    assert kv_budget.reserved_bytes(inside.engine.config, 3, 64) == kv_budget.reserved_bytes(off.engine.config, 3, 64)
    assert all(layer.self_attn.backend_state.cache.bank is None for layer in inside.model.layers if layer.self_attn.backend_state)


def test_engine_naming_a_removed_knob_loads(engines, tmp_path):
    """Engines built before solo_last_query was removed name it in config.json: they load (the
    key is ignored) and keep the rest of their plan."""
    old = tmp_path / "old-3k"
    shutil.copytree(engines["3k"], old)
    cfg = json.loads((old / "config.json").read_text())
    cfg["plan"]["knobs"]["infinitehip"]["solo_last_query"] = False
    (old / "config.json").write_text(json.dumps(cfg))
    loaded = EngineConfig.load(old).plan.knobs_of("infinitehip")
    assert loaded == EngineConfig.load(engines["3k"]).plan.knobs_of("infinitehip")
    assert not hasattr(loaded, "solo_last_query")
