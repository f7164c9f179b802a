"""When KV pages move to host memory, and the step-end mover that copies them there.

A request's pages move once its context reaches the InfiniteHiP threshold (every later step of
it runs the sparse kernels, which read host pages in place), keeping the sink and stream
tokens' pages on the GPU — and, when RoPE stays off inside the trained window, only past that
window: there prefill prunes from the raw-keys scratch (each offloaded key crosses PCIe once per
chunk), while inside it every query block's stages would read the host pages again (a 32K chunk
at 128K keys: 23 -> 398 ms per layer, measured). Needs every full-attention layer to run
InfiniteHiP (dense kernels do not follow host entries) and no token drop.
"""

from __future__ import annotations

import torch

from infhip.plugins.kv_offload import copy_pages
from infhip.runtime.kv_cache import KVCacheManager, OffloadSpec

# Pages of a request move once at least this many tokens' pages are eligible: fewer copy
# launches and page-table re-uploads, at the cost of that many more tokens on the GPU. Measured
# (benchmarks/bench_constants.py, H200, Llama-8B shapes): the smallest batch whose moves cost
# under 1 % of a 7.26 ms decode step, amortized: 0.44 % (bf16 KV), 0.92 % (fp8 KV; 16 tokens: 6.2 %).
OFFLOAD_BATCH_TOKENS = 128


def offload_spec(config, nbytes: int, page_bytes: int, num_global_layers: int) -> OffloadSpec | None:
    """The host pool of the full-attention ("global") layers for ``nbytes`` of host memory
    (None for 0); ValueError for a plan that cannot offload or a pool of no page."""
    if not nbytes:
        return None
    plan = config.plan
    ih = plan.infinitehip
    if ih is None or any(lp.plugin != "infinitehip" for lp in plan.layers if lp.attention == "global"):
        raise ValueError("KV offloading needs an engine whose full-attention layers all run InfiniteHiP "
                         "(build it with --preset 3k | 3k-fast | 3k-flash | 5k)")
    if plan.token_drop is not None:
        raise ValueError("KV offloading and token drop cannot be combined yet (token drop's gathers "
                         "read pages directly); load with token_drop=False")
    host_pages = nbytes // (page_bytes * num_global_layers)
    if host_pages < 1:
        raise ValueError(f"kv_offload_bytes={nbytes} holds no page of the {num_global_layers} "
                         f"full-attention layers ({page_bytes * num_global_layers} bytes per page)")
    window = config.model.max_position_embeddings
    min_context = max(ih.dense_threshold, window + 1) if ih.rope_off_in_trained_window else ih.dense_threshold
    return OffloadSpec(host_pages=host_pages, head_tokens=ih.n_sink, tail_tokens=ih.n_stream,
                       min_context=min_context, batch_pages=max(1, OFFLOAD_BATCH_TOKENS // config.build.page_size))


class PageMover:
    """After a step (its kernels already queued): move the pages that the step's requests no
    longer keep on the GPU to the host pools. The copies run on the same stream, ahead of any
    later kernel that could reuse the freed GPU pages."""

    def __init__(self, kv: KVCacheManager, layers: list, tensor):
        """layers: the attention modules whose PagedKV has a host twin; tensor(values, dtype)
        puts a host list on the device."""
        self.kv, self.layers, self.tensor = kv, layers, tensor

    def move(self, seqs_and_contexts) -> None:
        self.copy(*self.plan(seqs_and_contexts))

    def plan(self, seqs_and_contexts) -> tuple[list[int], list[int]]:
        """The moves (GPU pages, host pages), taken in the cache manager's page tables: host side.
        (Tensor parallelism: rank 0 plans, every rank copies its own heads' pages.)"""
        src, dst = [], []
        if not self.layers:
            return src, dst
        for seq, context in seqs_and_contexts:
            s, d = self.kv.offload(seq.seq_id, "global", context)
            src += s
            dst += d
        return src, dst

    def copy(self, src: list[int], dst: list[int]) -> None:
        """Copy GPU pages src to host pages dst in every offloading layer."""
        if not src:
            return
        src_t, dst_t = self.tensor(src, torch.int32), self.tensor(dst, torch.int32)
        for attn in self.layers:
            copy_pages(attn.kv, src_t, dst_t)
