"""How many KV pages each KV group gets: the device memory left for the cache, and its split.

The budget is what the caller gives (``kv_cache_memory_bytes``) or, on a GPU, the free memory
minus (1 - utilization) x total, minus what else a step needs (``reserved_bytes``: activations
of the largest step and each attention backend's own buffers), minus the staging buffers of an
offloaded cache, minus 1 GiB of slack. CPU: 2 GiB. Sliding-window groups get exactly what
max_num_seqs windows need; the global group the rest.

``plan_layout`` is what a runner calls at load: the host pool (offloading), the staging
buffers and the pages per group; ``allocate_layers`` then gives each attention layer its
PagedKV of its group's pages. Which page holds which token is the KVCacheManager's (the
scheduler allocates through it); nothing here hands out pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infhip.runtime.attention import Limits, backends
from infhip.runtime.attention.paged_kv import PagedKV
from infhip.runtime.kv_cache import KVCacheManager, KVGroupSpec, OffloadSpec
from infhip.runtime.offload.policy import offload_spec
from infhip.runtime.offload.staging import PrefillStaging

GiB = 1 << 30


def reserved_bytes(config, max_num_seqs: int, max_num_batched_tokens: int, value_banks: bool = False) -> int:
    """Device memory besides KV pages: a few [T, hidden] / [T, 2I] float32 activations of the
    largest step, plus what each attention backend the engine uses keeps (scratch, banks;
    value_banks: the runner offloads KV pages)."""
    cfg = config.model
    act = max_num_batched_tokens * (8 * cfg.hidden_size + 6 * cfg.intermediate_size) * 4
    if cfg.moe is not None:  # the fused experts' per-pair rows (plugins/moe.py: [T k, I] and [T k, hidden])
        act += max_num_batched_tokens * cfg.moe.top_k * (cfg.moe.intermediate_size + cfg.hidden_size) * 4
    limits = Limits(max_num_seqs, offloading=value_banks)
    return act + sum(cls.reserved_bytes(config, limits) for cls in backends() if cls.knobs_of(config) is not None)


def default_budget(config, device: torch.device, max_num_seqs: int, max_num_batched_tokens: int,
                   utilization: float, value_banks: bool = False, staging_bytes: int = 0) -> int:
    if device.type != "cuda":
        return 2 * GiB
    free, total = torch.cuda.mem_get_info(device)
    reserved = reserved_bytes(config, max_num_seqs, max_num_batched_tokens, value_banks) + staging_bytes
    return max(0, int(free - (1 - utilization) * total) - reserved - GiB)


def size_groups(layer_groups: list[str], windows: dict[str, int | None], page_bytes: int, page_size: int,
                max_seq_len: int, max_num_seqs: int, max_num_batched_tokens: int, budget: int,
                offload: OffloadSpec | None) -> dict[str, KVGroupSpec]:
    """Pages per KV group (layer_groups: each layer's group name). MemoryError when one
    sequence of max_seq_len does not fit."""
    specs: dict[str, KVGroupSpec] = {}
    for group in sorted(set(layer_groups), key=lambda g: g != "sliding"):
        num_layers = layer_groups.count(group)
        group_offload = offload if group == "global" else None
        per_seq = KVCacheManager.pages_for(windows[group], page_size, max_seq_len, max_num_batched_tokens,
                                           group_offload)
        wanted = max_num_seqs * per_seq + 1  # + the null page
        affordable = budget // (page_bytes * num_layers)
        num_pages = min(wanted, affordable)
        if num_pages < per_seq + 1:
            raise MemoryError(
                f"KV cache budget of {budget / GiB:.2f} GiB holds {affordable} pages of the "
                f"{group} layers, one sequence of {max_seq_len} tokens needs {per_seq + 1}; "
                "pass a larger kv_cache_memory_bytes or rebuild with a smaller --max-seq-len")
        budget -= num_pages * page_bytes * num_layers
        specs[group] = KVGroupSpec(num_pages=num_pages, window=windows[group], offload=group_offload)
    return specs


@dataclass
class KVLayout:
    """The KV memory of a runner: pages per group, the host pool, the staging buffers' pages."""

    specs: dict[str, KVGroupSpec]
    offload: OffloadSpec | None  # the global group's host pool, None without offloading
    staging_pages: int  # pages of each of the two staged-prefill buffers (runtime/offload/staging.py)
    dtype: torch.dtype  # the cache's


def plan_layout(engine, layers: list, max_num_seqs: int, max_num_batched_tokens: int,
                kv_cache_memory_bytes: int | None, utilization: float, kv_offload_bytes: int,
                max_pages_per_seq: int) -> KVLayout:
    """The KVLayout of a loaded engine's attention modules ``layers`` (budget: the bytes given,
    else default_budget; kv_offload_bytes: the host pool, 0 for none)."""
    from infhip.plugins.dtypes import KV_DTYPES

    cfg, build = engine.config.model, engine.config.build
    dtype = KV_DTYPES[build.kv_dtype]
    layer_groups = [a.kv_group for a in layers]
    # K and V pages (+ an fp8 cache's float32 scale per token and kv head, plugins/kv_quant.py)
    page_bytes = build.page_size * PagedKV.bytes_per_token(cfg.num_kv_heads, cfg.head_dim, dtype)
    offload = offload_spec(engine.config, kv_offload_bytes, page_bytes, layer_groups.count("global"))
    # staged prefill: two buffers of one sequence's host pages
    staging_pages = min(offload.host_pages, max_pages_per_seq) if offload else 0
    budget = kv_cache_memory_bytes or default_budget(
        engine.config, engine.device, max_num_seqs, max_num_batched_tokens, utilization, offload is not None,
        PrefillStaging.bytes_for(staging_pages, page_bytes))
    specs = size_groups(layer_groups, {a.kv_group: a.window for a in layers}, page_bytes, build.page_size,
                        build.max_seq_len, max_num_seqs, max_num_batched_tokens, budget, offload)
    return KVLayout(specs, offload, staging_pages, dtype)


def allocate_layers(layers: list, layout: KVLayout, page_size: int, device: torch.device) -> list:
    """Give each attention module of ``layers`` its PagedKV (its group's pages, + a host twin
    where the group offloads, plugins/kv_offload.py); returns the modules with a host twin."""
    for attn in layers:
        spec = layout.specs[attn.kv_group]
        host_pages = layout.offload.host_pages if spec.offload is not None else 0
        attn.kv = PagedKV.allocate(spec.num_pages, page_size, attn.num_kv_heads, attn.head_dim, layout.dtype,
                                   device, host_pages=host_pages)
    return [a for a in layers if a.kv.host is not None]
