"""The cases the dense-attention plugin tests share (tests/test_plugins_dense_attention*.py):
random sequences over a shuffled page pool (NaN wherever nothing may be read), the float64
reference of a decode step, packed prefill queries."""

import math

import torch

from infhip.plugins.dense_attention import dense_attention_ref
from infhip.plugins.paged_kv import PagedKV

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class PagedSeqs:
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
        self.paged = PagedKV(self.k_cache, self.v_cache)  # what the launchers take


def decode_expected(q, kv, contexts, scale, window):
    out = []
    for b, ctx in enumerate(contexts):
        if ctx == 0:
            out.append(torch.zeros_like(q[b], dtype=torch.float32))
            continue
        pos = torch.arange(ctx, device=DEVICE)
        out.append(dense_attention_ref(q[b][None], kv.keys[b], kv.values[b], pos[-1:], pos, scale, window)[0])
    return torch.stack(out)


def pack_queries(q_lens, Hq, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), Hq, D, generator=g).to(dtype).to(DEVICE)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    return q, cu
