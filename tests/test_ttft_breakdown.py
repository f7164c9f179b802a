"""benchmarks/speed/ttft_breakdown.py on a tiny 3k-flash engine (CPU, the plugins' torch references):
every engine step becomes one row whose categories add up to its wall time, the sparse chunks
show pruning stages and sparse attention, and the instrumentation is undone afterwards."""

import importlib

import pytest


@pytest.fixture(scope="module")
def tb():
    return importlib.import_module("benchmarks.speed.ttft_breakdown")  # the repository root is on sys.path


def test_breakdown_rows_add_up_and_restore(tb, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # torch references: the interpreter takes minutes here
    import infhip.methods.infinitehip.runtime.layer as ih
    from infhip import LLM
    from infhip.runtime.attention.dense import DENSE

    engine = tb.build(tmp_path, "bf16", 96, cpu=True, cpu_chunk=32)
    llm = LLM(engine, max_num_seqs=1, prefix_caching=False)
    originals = (ih.pruning_stage, ih.sparse_prefill_attention, DENSE.rope_and_write, llm.runner.execute)
    bd = tb.Breakdown(tb.Clock(cuda=False))
    restore = tb.instrument(llm, bd)
    try:
        tb.ttft(llm, 40, seed=3)  # chunks of 32: [0, 32) and [32, 40)
    finally:
        restore()
    assert [(r["chunk_end"], r["chunk_tokens"]) for r in bd.rows] == [(32, 32), (40, 8)]
    for r in bd.rows:
        parts = sum(r[c] for c in tb.CATEGORIES)
        assert parts == pytest.approx(r["wall_ms"], rel=1e-9, abs=1e-6)
        assert r["gpu_other"] > -1.0 and r["host"] > -1.0  # exclusive times: spans nest, never overlap
        assert r["linear"] > 0 and r["kv_write"] > 0
        assert set(r["linear_by_module"]) == {"qkv", "o", "gate_up", "down", "lm_head"}
        # every context is past dense_threshold 30 (TINY_IH): three stages and the sparse kernel
        assert all(r[s] > 0 for s in ("stage1", "stage2", "stage3", "sparse_attn")) and r["dense_attn"] == 0
    assert (ih.pruning_stage, ih.sparse_prefill_attention, DENSE.rope_and_write, llm.runner.execute) == originals
    assert "step" not in vars(llm) and "execute" not in vars(llm.runner)
    n = len(bd.rows)
    tb.ttft(llm, 20, seed=4)  # undone: no more rows
    assert len(bd.rows) == n
