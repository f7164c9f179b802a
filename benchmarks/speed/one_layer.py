"""One attention layer of Llama-3.1-8B on a paged cache, for the one-layer benchmarks
(bench_infinitehip.py, profile_prefill.py): its shapes, a random paged context, the SDPA baselines
and the RoPE styles the runtime uses at a context length."""

from __future__ import annotations

import math

from benchmarks.speed import timing
import torch
import torch.nn.functional as F

from infhip.plugins.paged_kv import PagedKV

HQ, HKV, D, PAGE = 32, 8, 128, 16
TRAINED_WINDOW = 131072
NUM_LAYERS = 32
CHUNK = 32768
SCALE = D ** -0.5
DEVICE = "cuda"


def shrink() -> None:
    """A --smoke run's layer (benchmarks/speed/tiny.py): 4 q / 2 kv heads of 16 on the CPU, chunks
    of 64, a 128-token trained window; importers of the constants re-read them after this."""
    global HQ, HKV, D, TRAINED_WINDOW, CHUNK, SCALE, DEVICE
    HQ, HKV, D, TRAINED_WINDOW, CHUNK, DEVICE = 4, 2, 16, 128, 64, "cpu"
    SCALE = D ** -0.5


def parse_len(s: str) -> int:
    s = s.strip().lower()
    mult = {"k": 1024, "m": 1024 * 1024}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "km" else s) * mult)


class PagedContext:
    """N random keys/values of one layer in a paged cache with shuffled pages (one sequence)."""

    def __init__(self, n: int, gen: torch.Generator):
        num_pages = math.ceil(n / PAGE) + 1
        self.n = n
        self.k_cache = torch.randn(num_pages, PAGE, HKV, D, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        self.v_cache = torch.randn(num_pages, PAGE, HKV, D, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        perm = torch.randperm(num_pages - 1, device=DEVICE, generator=gen) + 1  # page 0 = null page
        self.table = perm[:math.ceil(n / PAGE)].to(torch.int32)[None, :].contiguous()
        self.inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=DEVICE, dtype=torch.float32) / D))
        self.paged = PagedKV(self.k_cache, self.v_cache)  # what the launchers take

    def contiguous_kv(self, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of tokens [first, last) as [1, Hkv, L, D] (for SDPA)."""
        rows = torch.arange(first, last, device=DEVICE)
        pages = self.table[0, rows // PAGE].long()
        k = self.k_cache[pages, rows % PAGE].permute(1, 0, 2)[None].contiguous()
        v = self.v_cache[pages, rows % PAGE].permute(1, 0, 2)[None].contiguous()
        return k, v


# -- SDPA baselines --------------------------------------------------------------------------
def sdpa_decode_us(ctx: PagedContext, reps: int, gen) -> dict:
    q = torch.randn(1, HQ, 1, D, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    k, v = ctx.contiguous_kv(0, ctx.n)
    gqa = timing.graph_time_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), reps)
    ke, ve = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    expanded = timing.graph_time_us(lambda: F.scaled_dot_product_attention(q, ke, ve), reps)
    del ke, ve, k, v
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"gqa_us": gqa, "expanded_us": expanded, "us": min(gqa, expanded)}


def sdpa_prefill_ms(ctx: PagedContext, gen) -> dict:
    q = torch.randn(1, HQ, CHUNK, D, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    k, v = ctx.contiguous_kv(0, ctx.n)
    ke, ve = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    del k, v
    past = ctx.n - CHUNK
    t_past = timing.event_ms(lambda: F.scaled_dot_product_attention(q, ke[:, :, :past], ve[:, :, :past]), reps=3)
    t_self = timing.event_ms(lambda: F.scaled_dot_product_attention(q, ke[:, :, past:], ve[:, :, past:], is_causal=True))
    del ke, ve
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"past_ms": t_past, "self_ms": t_self, "ms": t_past + t_self}


# -- InfiniteHiP -----------------------------------------------------------------------------
def styles(n: int, cfg) -> tuple[str, str]:
    """(pruning RoPE, attention RoPE) the runtime uses for a normal layer at context n."""
    if cfg.rope_off_in_trained_window and n <= TRAINED_WINDOW:
        return "none", "none"
    return cfg.pruning_rope, cfg.attention_rope
