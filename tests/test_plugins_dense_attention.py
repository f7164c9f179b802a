"""Dense paged attention: the Triton flash-decoding kernel (interpreter on CPU) and the
SDPA prefill path against an explicit-softmax float64 reference."""

import math

import pytest
import torch

from infhip.plugins import dense_attention
from infhip.plugins.dense_attention import (
    choose_num_splits, dense_attention_ref, paged_decode_attention, paged_decode_attention_ref,
    paged_decode_attention_triton, paged_prefill_attention,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class PagedKV:
    """Random sequences scattered over a shuffled page pool. Unused slots, the null page
    and released (out-of-window) pages hold NaN, so any read of them poisons the output."""

    def __init__(self, contexts, Hkv, D, page_size, dtype, seed, release_before=None):
        g = torch.Generator().manual_seed(seed)
        pages_per_seq = [math.ceil(c / page_size) for c in contexts]
        num_pages = 1 + sum(pages_per_seq) + 3  # + null page + spare pages
        pool = (1 + torch.randperm(num_pages - 1, generator=g)).tolist()
        self.k_cache = torch.full((num_pages, page_size, Hkv, D), float("nan"), dtype=dtype)
        self.v_cache = torch.full_like(self.k_cache, float("nan"))
        max_pages = max(pages_per_seq) + 2  # trailing zero entries, like a real table
        self.block_tables = torch.zeros((len(contexts), max_pages), dtype=torch.int32)
        self.keys, self.values = [], []
        for b, ctx in enumerate(contexts):
            k = torch.randn(ctx, Hkv, D, generator=g).to(dtype)
            v = torch.randn(ctx, Hkv, D, generator=g).to(dtype)
            self.keys.append(k.to(DEVICE))
            self.values.append(v.to(DEVICE))
            for i in range(pages_per_seq[b]):
                page = pool.pop()
                rows = slice(i * page_size, min((i + 1) * page_size, ctx))
                n = rows.stop - rows.start
                self.k_cache[page, :n], self.v_cache[page, :n] = k[rows], v[rows]
                # sliding window: pages wholly before the first visible key are released
                first_visible = 0 if release_before is None else release_before[b]
                if (i + 1) * page_size > first_visible:
                    self.block_tables[b, i] = page
        self.k_cache, self.v_cache = self.k_cache.to(DEVICE), self.v_cache.to(DEVICE)
        self.block_tables = self.block_tables.to(DEVICE)
        self.context_lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)


def decode_expected(q, kv, contexts, scale, window):
    out = []
    for b, ctx in enumerate(contexts):
        if ctx == 0:
            out.append(torch.zeros_like(q[b], dtype=torch.float32))
            continue
        pos = torch.arange(ctx, device=DEVICE)
        out.append(dense_attention_ref(q[b][None], kv.keys[b], kv.values[b], pos[-1:], pos, scale, window)[0])
    return torch.stack(out)


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
    kv = PagedKV(contexts, Hkv, D, page_size, dtype, seed=10 + Hq + page_size, release_before=release)
    q = torch.randn(len(contexts), Hq, D, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    scale = D ** -0.5
    expected = decode_expected(q, kv, contexts, scale, window)
    got = paged_decode_attention_triton(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, scale,
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
    kv = PagedKV(contexts, 2, 16, 4, torch.float32, seed=3)
    q = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    out = torch.full_like(q, 7.0)
    res = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.3, out=out)
    assert res.data_ptr() == out.data_ptr()
    expected = decode_expected(q, kv, contexts, 0.3, None)
    assert rel_err(out, expected) < TOL[torch.float32]
    if DEVICE == "cpu":  # also exercise the launcher's own split choice in the interpreter
        got = paged_decode_attention_triton(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.3)
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
    kv = PagedKV(contexts, 2, 16, 4, torch.float32, seed=4)
    wide = torch.cat([kv.block_tables, torch.zeros(2, 200, dtype=torch.int32, device=kv.block_tables.device)], 1)
    q = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    expected = decode_expected(q, kv, contexts, 0.3, None)
    for max_len in (None, 80, 512):
        got = paged_decode_attention(q, kv.k_cache, kv.v_cache, wide.contiguous(), kv.context_lens, 0.3,
                                     max_len=max_len)
        assert rel_err(got, expected) < TOL[torch.float32]


# ----------------------------------------------------------------------------- prefill

def pack_queries(q_lens, Hq, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), Hq, D, generator=g).to(dtype).to(DEVICE)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    return q, cu


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
    kv = PagedKV(contexts, Hkv, D, page_size, dtype, seed=20 + D, release_before=release)
    q, cu = pack_queries(q_lens, Hq, D, dtype, seed=21)
    # fresh k/v rows for the packed queries (used by the no-gather fast path)
    k_new = torch.cat([kv.keys[b][c - n:] for b, (c, n) in enumerate(zip(contexts, q_lens))])
    v_new = torch.cat([kv.values[b][c - n:] for b, (c, n) in enumerate(zip(contexts, q_lens))])
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    scale = 0.7 * D ** -0.5
    got = paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, cu_t, kv.context_lens, scale,
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
    dec = paged_decode_attention_triton(q[last].contiguous(), kv.k_cache, kv.v_cache, kv.block_tables,
                                        kv.context_lens, scale, window=window, num_splits=2, block_n=16)
    assert rel_err(dec, got[last]) < TOL[dtype]


def test_prefill_gqa_without_k_new_gathers_from_cache():
    contexts, q_lens = [12, 33], [12, 4]
    kv = PagedKV(contexts, 2, 16, 4, torch.float32, seed=5)
    q, cu = pack_queries(q_lens, 6, 16, torch.float32, seed=6)
    got = paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
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
    kv = PagedKV(contexts, Hkv, D, page_size, torch.bfloat16, seed=9)
    q = torch.randn(batch, Hq, D, device=DEVICE, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, D ** -0.5)
    paged_decode_attention(*args, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(*args, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    expected = decode_expected(q, kv, contexts, D ** -0.5, None)
    assert torch.isfinite(out).all() and rel_err(out, expected) < TOL[torch.bfloat16]
