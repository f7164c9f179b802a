"""InfiniteHiP shared pieces: query blocks, key sets, the RoPE-delta convention; and the paged
random sequences the other test_infinitehip_* files build on."""

from __future__ import annotations

import math

import torch

from infhip.plugins.infinitehip import (PAD, block_key_mask, initial_candidates, plan_query_blocks,
                                        rotate_by_ref, selected_range, stream_starts)
from infhip.plugins.kv_quant import dequantize_rows, quantize_rows
from infhip.plugins.paged_kv import PagedKV
from infhip.plugins.rope import apply_rope_ref_

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def inv_freq(D, base=10000.0):
    return (1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float32) / D)).to(DEVICE)


def random_rows(g, shape, dyadic=False, dtype=torch.float32):
    """Random values; dyadic ones (multiples of 1/4 in [-1, 1]) make every float32 dot product
    of D <= 64 terms exact, so kernel and float64 reference agree bit for bit (ties included)."""
    if dyadic:
        return (torch.randint(-4, 5, shape, generator=g).float() / 4).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


class PagedSeqs:
    """Random sequences scattered over a shuffled page pool; unused slots and the null page hold
    NaN so any stray read poisons the result. keys/values: per sequence [ctx, Hkv, D]."""

    def __init__(self, contexts, Hkv, D, page_size, seed, dyadic=False, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        pages = [math.ceil(c / page_size) for c in contexts]
        num_pages = 1 + sum(pages) + 2
        pool = (1 + torch.randperm(num_pages - 1, generator=g)).tolist()
        self.k_cache = torch.full((num_pages, page_size, Hkv, D), float("nan"), dtype=dtype)
        self.v_cache = torch.full_like(self.k_cache, float("nan"))
        self.block_tables = torch.zeros((len(contexts), max(pages) + 1), dtype=torch.int32)
        self.keys, self.values = [], []
        for b, ctx in enumerate(contexts):
            k = random_rows(g, (ctx, Hkv, D), dyadic, dtype)
            v = random_rows(g, (ctx, Hkv, D), False, dtype)
            self.keys.append(k.to(DEVICE))
            self.values.append(v.to(DEVICE))
            for i in range(pages[b]):
                page = pool.pop()
                n = min(page_size, ctx - i * page_size)
                self.k_cache[page, :n] = k[i * page_size:i * page_size + n]
                self.v_cache[page, :n] = v[i * page_size:i * page_size + n]
                self.block_tables[b, i] = page
        self.k_cache, self.v_cache = self.k_cache.to(DEVICE), self.v_cache.to(DEVICE)
        self.block_tables = self.block_tables.to(DEVICE)
        self.context_lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
        self.generator = g

    @property
    def paged(self) -> PagedKV:
        """The caches as the launchers take them."""
        return PagedKV(self.k_cache, self.v_cache)

    def blocks(self, q_lens, block_q):
        """Query blocks of the sequences' newest q_lens tokens: (q_start, q_lens, ends, tables)."""
        q_start, lens, ends, seq = plan_query_blocks(q_lens, self.context_lens.tolist(), block_q, DEVICE)
        return q_start, lens, ends, self.block_tables[seq.long()]


class Fp8Caches:
    """fp8 copies of a PagedSeqs' caches (kv_quant.quantize_rows): k_cache / v_cache
    float8_e4m3fn [num_pages, page_size, Hkv, D], k_scale / v_scale float32 [num_pages, page_size,
    Hkv]. NaN rows (unused slots, the null page) stay NaN, so stray reads still poison."""

    def __init__(self, k_cache, k_scale, v_cache, v_scale):
        self.k_cache, self.k_scale, self.v_cache, self.v_scale = k_cache, k_scale, v_cache, v_scale

    def scales(self):
        return dict(k_scale=self.k_scale, v_scale=self.v_scale)

    @property
    def paged(self) -> PagedKV:
        """The caches and their scales as the launchers take them."""
        return PagedKV(self.k_cache, self.v_cache, self.k_scale, self.v_scale)


def paged_args(args: tuple) -> tuple:
    """(q, k_cache, v_cache, *rest), the references' arguments, as the launchers take them:
    (q, PagedKV(k_cache, v_cache), *rest)."""
    q, k_cache, v_cache, *rest = args
    return (q, PagedKV(k_cache, v_cache), *rest)


def quantize_seqs(seqs: PagedSeqs) -> Fp8Caches:
    """Quantize seqs' caches to fp8 + scales, and replace seqs.k_cache / v_cache (and keys /
    values) by the float32 *dequantized* values: the fp8 kernels must compute what the float32
    ones (and the references) compute on seqs afterwards."""
    k8, ks = quantize_rows(seqs.k_cache)
    v8, vs = quantize_rows(seqs.v_cache)
    seqs.k_cache = dequantize_rows(k8, ks, torch.float32)
    seqs.v_cache = dequantize_rows(v8, vs, torch.float32)
    seqs.keys = [dequantize_rows(*quantize_rows(k), torch.float32) for k in seqs.keys]
    seqs.values = [dequantize_rows(*quantize_rows(v), torch.float32) for v in seqs.values]
    return Fp8Caches(k8, ks, v8, vs)


def kv_caches(seqs: PagedSeqs, fp8: bool):
    """(k_cache, v_cache, scale kwargs) to run the kernels on: seqs' own caches (no scales), or
    fp8 copies with their row scales (quantize_seqs: seqs then holds the dequantized values)."""
    if not fp8:
        return seqs.k_cache, seqs.v_cache, {}
    c = quantize_seqs(seqs)
    return c.k_cache, c.v_cache, c.scales()


# ----------------------------------------------------------------------------- blocks.py

def test_plan_query_blocks_layout():
    q_start, q_lens, ends, seq = plan_query_blocks([5, 0, 9], [12, 7, 9], block_q=4)
    assert q_start.tolist() == [0, 4, 5, 9, 13]
    assert q_lens.tolist() == [4, 1, 4, 4, 1]
    assert ends.tolist() == [11, 12, 4, 8, 9]  # sequence 2 is all query: positions 0..8
    assert seq.tolist() == [0, 0, 2, 2, 2]


def test_key_sets_sink_middle_stream():
    ends = torch.tensor([40, 9, 3], dtype=torch.int32)
    n_sink, n_stream = 4, 8
    assert stream_starts(ends, n_sink, n_stream).tolist() == [32, 4, 3]
    cand, lens = initial_candidates(ends, n_sink, n_stream)
    assert lens.tolist() == [28, 0, 0] and cand[0, :28].tolist() == list(range(4, 32))
    assert (cand[1:] == PAD).all()
    # 2 and 35 are outside the middle of block 0 (sink / stream): ignored, never doubled
    selected = torch.tensor([[2, 10, 11, 35, PAD], [5, PAD, PAD, PAD, PAD], [PAD] * 5], dtype=torch.int32)
    begin, end = selected_range(selected, ends, n_sink, n_stream)
    assert begin.tolist() == [1, 0, 0] and end.tolist() == [3, 0, 0]
    mask = block_key_mask(selected, ends, n_sink, n_stream, 40)
    assert mask[0].nonzero()[:, 0].tolist() == [0, 1, 2, 3, 10, 11] + list(range(32, 40))
    assert mask[1].nonzero()[:, 0].tolist() == list(range(9))
    assert mask[2].nonzero()[:, 0].tolist() == [0, 1, 2]


def test_rope_delta_matches_rope_at_new_position():
    """R(p + delta) x == R(delta) R(p) x with plugins/rope.py's neox convention, which is how the
    kernels move cached (already rotated) keys to a style's position."""
    g = torch.Generator().manual_seed(1)
    D, n = 32, 7
    x = torch.randn(n, 2, D, generator=g)
    pos = torch.randint(0, 5000, (n,), generator=g)
    delta = torch.randint(-5000, 5000, (n,), generator=g)
    freq = inv_freq(D).cpu()
    at_pos, at_new = x.clone(), x.clone()
    apply_rope_ref_(at_pos, torch.zeros(n, 1, D), pos, freq, 1.0)
    apply_rope_ref_(at_new, torch.zeros(n, 1, D), pos + delta, freq, 1.0)
    assert rel_err(rotate_by_ref(at_pos, delta, freq), at_new) < 1e-4  # float32 angles of HF style
