"""Dense paged attention: the Triton flash-decoding kernel (interpreter on CPU) and the
SDPA prefill path against an explicit-softmax float64 reference. Over an fp8 cache:
tests/test_plugins_dense_attention_fp8.py."""

import pytest
import torch

from infhip.plugins import dense_attention
from infhip.plugins.dense_attention import (
    choose_num_splits, dense_attention_ref, paged_decode_attention, paged_decode_attention_ref,
    paged_decode_attention_triton, paged_prefill_attention,
)
from tests._dense_cases import DEVICE, TOL, PagedSeqs, decode_expected, pack_queries, rel_err


DECODE_CASES = [
    # Hq, Hkv, D, page_size, dtype, block_n
    (6, 2, 16, 4, torch.float32, 16),
    (3, 3, 64, 16, torch.bfloat16, 16),
    (6, 2, 16, 16, torch.bfloat16, 32),
    (4, 1, 24, 4, torch.float32, 16),  # head dim not a power of two (masked lanes)
]


@pytest.mark.parametrize("Hq,Hkv,D,page_size,dtype,block_n", DECODE_CASES)
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_triton_vs_reference(Hq, Hkv, D, page_size, dtype, block_n, window, num_splits):
    contexts = [1, 5, 37, 0, 70]  # 0 = padded batch slot (CUDA graphs)
    release = [max(0, c - window) for c in contexts] if window else None
    kv = PagedSeqs(contexts, Hkv, D, page_size, dtype, seed=10 + Hq + page_size, release_before=release)
    q = torch.randn(len(contexts), Hq, D, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    scale = D ** -0.5
    expected = decode_expected(q, kv, contexts, scale, window)
    got = paged_decode_attention_triton(q, kv.paged, kv.block_tables, kv.context_lens, scale,
                                        window=window, num_splits=num_splits, block_n=block_n)
    assert got.shape == q.shape and got.dtype == dtype
    assert torch.isfinite(got).all(), "read a NaN page: masked/released memory was touched"
    assert torch.equal(got[3], torch.zeros_like(got[3])), "padded slot must give zeros"
    assert rel_err(got, expected) < TOL[dtype]
    # torch path (the CPU dispatch) against the same reference
    torch_out = paged_decode_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens,
                                           scale, window)
    assert torch.equal(torch_out[3], torch.zeros_like(torch_out[3]))
    assert rel_err(torch_out, expected) < TOL[dtype]


def test_decode_writes_into_out_and_default_splits():
    contexts = [37, 70]
    kv = PagedSeqs(contexts, 2, 16, 4, torch.float32, seed=3)
    q = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    out = torch.full_like(q, 7.0)
    res = paged_decode_attention(q, kv.paged, kv.block_tables, kv.context_lens, 0.3, out=out)
    assert res.data_ptr() == out.data_ptr()
    expected = decode_expected(q, kv, contexts, 0.3, None)
    assert rel_err(out, expected) < TOL[torch.float32]
    if DEVICE == "cpu":  # also exercise the launcher's own split choice in the interpreter
        got = paged_decode_attention_triton(q, kv.paged, kv.block_tables, kv.context_lens, 0.3)
        assert rel_err(got, expected) < TOL[torch.float32]


def test_choose_num_splits_depends_on_shapes_only():
    assert choose_num_splits(1, 8, 2048, 132) == 33  # batch 1, 128K context: 2 waves of SMs
    assert choose_num_splits(16, 8, 2048, 132) == 3
    assert choose_num_splits(64, 8, 2048, 132) == 1
    assert choose_num_splits(1, 8, 2, 132) == 2  # never more splits than key blocks
    assert choose_num_splits(1, 1, 512, 132) == 128  # one kv head (Gemma-3 270M): capped
    # decode's minimum of 4 blocks per split: short contexts take one split (no merge kernel)
    assert choose_num_splits(1, 8, 3, 132, min_blocks_per_split=4) == 1
    assert choose_num_splits(1, 8, 16, 132, min_blocks_per_split=4) == 4
    assert choose_num_splits(1, 8, 2048, 132, min_blocks_per_split=4) == 33


def test_decode_max_len_bounds_the_split_count_not_the_result():
    """A block table much wider than the contexts (a CUDA graph's): max_len, a bound on the
    contexts, sizes the launch; the answer is the same with or without it."""
    from infhip.runtime.cuda_graphs import len_bucket
    assert [len_bucket(n) for n in (1, 512, 513, 8192, 8193)] == [512, 512, 2048, 8192, None]
    contexts = [37, 70]
    kv = PagedSeqs(contexts, 2, 16, 4, torch.float32, seed=4)
    wide = torch.cat([kv.block_tables, torch.zeros(2, 200, dtype=torch.int32, device=kv.block_tables.device)], 1)
    q = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    expected = decode_expected(q, kv, contexts, 0.3, None)
    for max_len in (None, 80, 512):
        got = paged_decode_attention(q, kv.paged, wide.contiguous(), kv.context_lens, 0.3,
                                     max_len=max_len)
        assert rel_err(got, expected) < TOL[torch.float32]


# ----------------------------------------------------------------------------- prefill

PREFILL_CASES = [
    # Hq, Hkv, D, page_size, dtype
    (6, 2, 16, 4, torch.float32),
    (3, 3, 64, 16, torch.bfloat16),
]


@pytest.mark.parametrize("Hq,Hkv,D,page_size,dtype", PREFILL_CASES)
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("pass_lists", [False, True])
def test_prefill_vs_reference_and_decode(Hq, Hkv, D, page_size, dtype, window, pass_lists, monkeypatch):
    if pass_lists:  # windowed queries in several SDPA slices of 4 rows
        monkeypatch.setattr(dense_attention, "_PREFILL_MIN_Q_SLICE", 4)
        monkeypatch.setattr(dense_attention, "_PREFILL_MAX_Q_SLICE", 4)
    contexts = [5, 37, 70, 9, 20]
    q_lens = [5, 10, 1, 3, 20]  # fresh prompt, chunked continuation, one token, ..., fresh
    release = [max(0, c - n - window + 1) for c, n in zip(contexts, q_lens)] if window else None
    kv = PagedSeqs(contexts, Hkv, D, page_size, dtype, seed=20 + D, release_before=release)
    q, cu = pack_queries(q_lens, Hq, D, dtype, seed=21)
    # fresh k/v rows for the packed queries (used by the no-gather fast path)
    k_new = torch.cat([kv.keys[b][c - n:] for b, (c, n) in enumerate(zip(contexts, q_lens))])
    v_new = torch.cat([kv.values[b][c - n:] for b, (c, n) in enumerate(zip(contexts, q_lens))])
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    scale = 0.7 * D ** -0.5
    got = paged_prefill_attention(q, kv.paged, kv.block_tables, cu_t, kv.context_lens, scale,
                                  window=window, k_new=k_new, v_new=v_new,
                                  cu_seqlens_q_list=cu if pass_lists else None,
                                  context_lens_list=contexts if pass_lists else None)
    assert got.shape == q.shape and torch.isfinite(got).all()
    for b, (ctx, n) in enumerate(zip(contexts, q_lens)):
        pos = torch.arange(ctx, device=DEVICE)
        expected = dense_attention_ref(q[cu[b]:cu[b + 1]], kv.keys[b], kv.values[b], pos[ctx - n:], pos,
                                       scale, window)
        assert rel_err(got[cu[b]:cu[b + 1]], expected) < TOL[dtype], f"sequence {b}"

    # decode of each sequence's last query == the last prefill row
    last = torch.tensor([c - 1 for c in cu[1:]], device=DEVICE)
    dec = paged_decode_attention_triton(q[last].contiguous(), kv.paged, kv.block_tables,
                                        kv.context_lens, scale, window=window, num_splits=2, block_n=16)
    assert rel_err(dec, got[last]) < TOL[dtype]


def test_prefill_gqa_without_k_new_gathers_from_cache():
    contexts, q_lens = [12, 33], [12, 4]
    kv = PagedSeqs(contexts, 2, 16, 4, torch.float32, seed=5)
    q, cu = pack_queries(q_lens, 6, 16, torch.float32, seed=6)
    got = paged_prefill_attention(q, kv.paged, kv.block_tables,
                                  torch.tensor(cu, dtype=torch.int32, device=DEVICE), kv.context_lens, 0.25)
    for b, (ctx, n) in enumerate(zip(contexts, q_lens)):
        pos = torch.arange(ctx, device=DEVICE)
        expected = dense_attention_ref(q[cu[b]:cu[b + 1]], kv.keys[b], kv.values[b], pos[ctx - n:], pos, 0.25)
        assert rel_err(got[cu[b]:cu[b + 1]], expected) < TOL[torch.float32]


def test_dense_attention_ref_masks():
    """The reference itself: one visible key gives that key's value; windows cut old keys."""
    g = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(3, 2, 8, generator=g), torch.randn(4, 1, 8, generator=g), torch.randn(4, 1, 8, generator=g)
    out = dense_attention_ref(q, k, v, torch.tensor([0, 2, 3]), torch.arange(4), 1.0, window=1)
    assert torch.allclose(out[0], v[0].expand(2, 8)) and torch.allclose(out[2], v[3].expand(2, 8))
    none = dense_attention_ref(q, k, v, torch.tensor([-1, 0, 1]), torch.arange(4), 1.0)
    assert torch.equal(none[0], torch.zeros(2, 8))


# ----------------------------------------------------------------------------- GPU only

@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 16])
def test_decode_llama_shapes_cuda_graph(batch):
    """Llama-3.1-8B decode shapes in bf16, captured in a CUDA graph and replayed."""
    Hq, Hkv, D, page_size = 32, 8, 128, 16
    contexts = [3000 + 517 * b for b in range(batch)]
    contexts[-1] = 0 if batch > 1 else contexts[-1]
    kv = PagedSeqs(contexts, Hkv, D, page_size, torch.bfloat16, seed=9)
    q = torch.randn(batch, Hq, D, device=DEVICE, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    args = (q, kv.paged, kv.block_tables, kv.context_lens, D ** -0.5)
    paged_decode_attention(*args, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(*args, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    expected = decode_expected(q, kv, contexts, D ** -0.5, None)
    assert torch.isfinite(out).all() and rel_err(out, expected) < TOL[torch.bfloat16]

