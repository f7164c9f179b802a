"""InfiniteHiP kernels on the GPU at Llama-3.1-8B head shapes (32 q / 8 kv heads, d = 128, bf16,
page 16): compiled Triton (not the interpreter) against the float64 references, at contexts of
thousands of tokens, decode and prefill blocks. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from infhip.plugins.infinitehip import (pruning_stage, pruning_stage_ref, sparse_attention_ref,
                                        sparse_decode_attention, sparse_prefill_attention)

from .test_infinitehip_common import DEVICE, PagedSeqs, inv_freq, paged_args, random_rows, rel_err
from .test_infinitehip_pruning import chosen_chunk_scores
from .test_infinitehip_sparse_attention import random_selection

pytestmark = pytest.mark.gpu

HQ, HKV, D, PAGE = 32, 8, 128, 16
N_SINK, N_STREAM = 64, 256
CONTEXTS = [6007, 2501]


@pytest.mark.parametrize("block_q,q_lens,query_stride", [(1, [1, 1], 1), (64, [150, 64], 1), (64, [150, 64], 4)])
@pytest.mark.parametrize("rope_style", ["none", "relative", "chunk_indexed"])
def test_pruning_stage_exact_at_llama8b_shapes(block_q, q_lens, query_stride, rope_style):
    """Dyadic bf16 inputs make every q.k exact in float32 accumulation, so the kept chunks must
    have exactly the reference's scores (stage 1 implicit, then an explicit stage). Stride 4
    gives 64-row query tiles, which stage 1 scores as [chunks, queries] (keys_as_rows)."""
    seqs = PagedSeqs(CONTEXTS, HKV, D, PAGE, seed=block_q, dyadic=rope_style == "none", dtype=torch.bfloat16)
    q = random_rows(seqs.generator, (sum(q_lens), HQ, D), rope_style == "none", torch.bfloat16).to(DEVICE)
    q_start, lens, ends, tables = seqs.blocks(q_lens, block_q)
    kw = dict(block_q=block_q, n_sink=N_SINK, n_stream=N_STREAM, rope_style=rope_style, inv_freq=inv_freq(D),
              query_stride=query_stride)
    sel, n = pruning_stage(q, seqs.paged, tables, q_start, lens, ends, chunk_size=32, k=1024,
                           max_candidates=max(CONTEXTS), **kw)
    ref, ref_n = pruning_stage_ref(q, seqs.k_cache, tables, q_start, lens, ends, chunk_size=32, k=1024,
                                   max_candidates=max(CONTEXTS), **{k: v for k, v in kw.items() if k != "block_q"})
    assert torch.equal(n.cpu(), ref_n.cpu())
    if rope_style == "none":  # exact arithmetic: identical chunk scores of the kept sets
        from infhip.plugins.infinitehip import select_rep_scores_ref
        scores, _, _ = select_rep_scores_ref(q, seqs.k_cache, tables, q_start, lens, ends, None, None,
                                             chunk_size=32, n_sink=N_SINK, n_stream=N_STREAM,
                                             max_candidates=max(CONTEXTS), query_stride=query_stride)
        assert chosen_chunk_scores(sel, n, None, scores, 32) == chosen_chunk_scores(ref, ref_n, None, scores, 32)
    else:  # rotations round differently in bf16/float32 vs float64: near-identical sets
        same = [len(set(a[:m].tolist()) & set(b[:m].tolist())) / int(m)
                for a, b, m in zip(sel.cpu(), ref.cpu(), n.cpu()) if m]
        assert min(same) > 0.9, same


@pytest.mark.parametrize("rope_style", ["none", "relative"])
def test_last_stage_exact_at_llama8b_shapes(rope_style):
    """A last stage (l_c 8 over the reference stage 1's survivors, candidates in runs, 64-query
    blocks: 256-row query tiles): with dyadic inputs the kept chunks have exactly the
    reference's scores; with relative RoPE from un-rotated keys (the prefill path)
    near-identical sets."""
    from infhip.plugins.infinitehip import select_rep_scores_ref

    from .test_infinitehip_pruning import raw_keys_of
    q_lens, block_q = [150, 64], 64
    seqs = PagedSeqs(CONTEXTS, HKV, D, PAGE, seed=7, dyadic=rope_style == "none", dtype=torch.bfloat16)
    q = random_rows(seqs.generator, (sum(q_lens), HQ, D), rope_style == "none", torch.bfloat16).to(DEVICE)
    q_start, lens, ends, tables = seqs.blocks(q_lens, block_q)
    kw = dict(n_sink=N_SINK, n_stream=N_STREAM, rope_style=rope_style, inv_freq=inv_freq(D))
    cand, cand_n = pruning_stage_ref(q, seqs.k_cache, tables, q_start, lens, ends, chunk_size=32, k=1024,
                                     max_candidates=max(CONTEXTS), **kw)
    cand, cand_n = cand.to(DEVICE), cand_n.to(DEVICE)
    raw = raw_keys_of(seqs, q_lens, block_q, inv_freq(D)) if rope_style != "none" else None
    sel, n = pruning_stage(q, seqs.paged, tables, q_start, lens, ends, cand, cand_n, chunk_size=8, k=256,
                           block_q=block_q, raw_keys=raw, **kw)
    ref, ref_n = pruning_stage_ref(q, seqs.k_cache, tables, q_start, lens, ends, cand, cand_n, chunk_size=8,
                                   k=256, **kw)
    assert torch.equal(n.cpu(), ref_n.cpu()) and int(n.min()) > 0
    if rope_style == "none":
        scores, _, _ = select_rep_scores_ref(q, seqs.k_cache, tables, q_start, lens, ends, cand, cand_n,
                                             chunk_size=8, n_sink=N_SINK, n_stream=N_STREAM)
        assert chosen_chunk_scores(sel, n, cand, scores, 8) == chosen_chunk_scores(ref, ref_n, cand, scores, 8)
    else:
        same = [len(set(a[:m].tolist()) & set(b[:m].tolist())) / int(m)
                for a, b, m in zip(sel.cpu(), ref.cpu(), n.cpu())]
        assert min(same) > 0.9, same


@pytest.mark.parametrize("rope_style", ["none", "streaming"])
def test_sparse_decode_at_llama8b_shapes(rope_style):
    seqs = PagedSeqs(CONTEXTS, HKV, D, PAGE, seed=3, dtype=torch.bfloat16)
    q = torch.randn(len(CONTEXTS), HQ, D, generator=seqs.generator).to(torch.bfloat16).to(DEVICE)
    sel = random_selection(seqs.generator, seqs.context_lens, N_SINK, N_STREAM, k=2048)
    args = (q, seqs.k_cache, seqs.v_cache, seqs.block_tables)
    opts = dict(n_sink=N_SINK, n_stream=N_STREAM, scale=D ** -0.5, rope_style=rope_style, inv_freq=inv_freq(D))
    out = sparse_decode_attention(*paged_args(args), seqs.context_lens, sel, **opts)
    ones = torch.ones(len(CONTEXTS), dtype=torch.int32, device=DEVICE)
    ref = sparse_attention_ref(*args, torch.arange(len(CONTEXTS), dtype=torch.int32, device=DEVICE), ones,
                               seqs.context_lens, sel, **opts)
    assert rel_err(out, ref) < 2e-2


@pytest.mark.parametrize("rope_style", ["streaming", "none"])  # the launches differ (warps, pipeline depth)
def test_sparse_prefill_at_llama8b_shapes(rope_style):
    seqs = PagedSeqs(CONTEXTS, HKV, D, PAGE, seed=5, dtype=torch.bfloat16)
    q_lens = [300, 77]
    q = torch.randn(sum(q_lens), HQ, D, generator=seqs.generator).to(torch.bfloat16).to(DEVICE)
    q_start, lens, ends, tables = seqs.blocks(q_lens, 64)
    sel = random_selection(seqs.generator, ends, N_SINK, N_STREAM, k=1024)
    opts = dict(n_sink=N_SINK, n_stream=N_STREAM, scale=D ** -0.5, rope_style=rope_style, inv_freq=inv_freq(D))
    out = torch.full_like(q, float("nan"))
    sparse_prefill_attention(q, seqs.paged, tables, q_start, lens, ends, sel, block_q=64,
                             out=out, **opts)
    ref = sparse_attention_ref(q, seqs.k_cache, seqs.v_cache, tables, q_start, lens, ends, sel, **opts)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 2e-2


@pytest.mark.parametrize("preset", ["3k", "3k-flash"])
def test_sparse_decode_cuda_graphs_equal_eager(tmp_path, preset):
    """A tiny float32 engine whose contexts are all past dense_threshold: decode through the
    sparse CUDA graphs (one per batch size and refresh pattern, captured on first use; 8 steps
    fused per host sync; requests joining late run their full first step eagerly) gives the
    eager path's tokens over several refresh cycles, and the graphs did run."""
    from infhip import LLM, SamplingParams
    from infhip.builder.build import build_engine

    from .test_infinitehip_runtime import PROMPTS, TINY
    from ._tiny import write_tiny_hf_checkpoint

    write_tiny_hf_checkpoint(tmp_path / "hf", "llama")
    engine = build_engine(checkpoint=tmp_path / "hf", output_dir=tmp_path / "e", dtype="float32", device="cuda",
                          max_seq_len=400, max_batch_size=4, preset=preset,
                          infinitehip_overrides=dict(TINY, dense_threshold=30), progress=False)
    sp = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    graphed = LLM(engine, kv_cache_memory_bytes=1 << 28, max_num_batched_tokens=64)
    out = [o.token_ids for o in graphed.generate(prompt_token_ids=PROMPTS, sampling_params=sp)]
    captured = graphed.debug_view()["graphs"]["captured"]
    assert sum(g["backends"].get("infinitehip") is not None for g in captured) >= 4  # several patterns and batch sizes replayed
    eager = LLM(engine, kv_cache_memory_bytes=1 << 28, max_num_batched_tokens=64, enforce_eager=True)
    assert out == [o.token_ids for o in eager.generate(prompt_token_ids=PROMPTS, sampling_params=sp)]
