"""When KV pages move to host memory, and the step-end mover that copies them there.

A request's pages move once its context reaches the attention backend's ``offload_window``
(runtime/attention/backend.py): from then on every step of it runs that backend's kernels,
which read host pages in place, and the window's head and tail tokens' pages stay on the GPU.
For InfiniteHiP that is its dense threshold — and, when RoPE stays off inside the trained
window, only past that window: there prefill prunes from the raw-keys scratch (each offloaded key
crosses PCIe once per chunk), while inside it every query block's stages would read the host
pages again (a 32K chunk at 128K keys: 23 -> 398 ms per layer, measured); sink and stream stay.
Needs every full-attention layer to run such a backend (dense kernels do not follow host
entries) and no token drop.
"""

from __future__ import annotations

import torch

from infhip.plugins.kv_offload import copy_pages
from infhip.runtime.attention import backends
from infhip.runtime.kv_cache import KVCacheManager, OffloadSpec
from infhip.runtime.step_transform import transforms

# Pages of a request move once at least this many tokens' pages are eligible: fewer copy
# launches and page-table re-uploads, at the cost of that many more tokens on the GPU. Measured
# (benchmarks/speed/bench_constants.py, H200, Llama-8B shapes): the smallest batch whose moves cost
# under 1 % of a 7.26 ms decode step, amortized: 0.44 % (bf16 KV), 0.92 % (fp8 KV; 16 tokens: 6.2 %).
OFFLOAD_BATCH_TOKENS = 128


def offload_spec(config, nbytes: int, page_bytes: int, num_global_layers: int) -> OffloadSpec | None:
    """The host pool of the full-attention ("global") layers for ``nbytes`` of host memory
    (None for 0); ValueError for a plan that cannot offload or a pool of no page."""
    if not nbytes:
        return None
    plan = config.plan
    full = {lp.index for lp in plan.layers if lp.attention == "global"}
    windows = [w for cls in backends() if cls.knobs_of(config) is not None and full <= set(cls.layers_of(config))
               and (w := cls.offload_window(config)) is not None]
    if not windows:
        hints = "; ".join(cls.offload_hint for cls in backends() if cls.offload_hint)
        raise ValueError("KV offloading needs an engine whose full-attention layers all run an attention backend "
                         f"that reads host pages ({hints})")
    on = [cls for cls in transforms() if cls.knobs_of(config) is not None]
    if on:  # a transform's kernels (token drop's gathers) read pages directly
        raise ValueError(f"KV offloading and {on[0].name} cannot be combined yet (its kernels read pages "
                         f"directly); load with {on[0].name}=False")
    host_pages = nbytes // (page_bytes * num_global_layers)
    if host_pages < 1:
        raise ValueError(f"kv_offload_bytes={nbytes} holds no page of the {num_global_layers} "
                         f"full-attention layers ({page_bytes * num_global_layers} bytes per page)")
    min_context, head, tail = windows[0]
    return OffloadSpec(host_pages=host_pages, head_tokens=head, tail_tokens=tail,
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
