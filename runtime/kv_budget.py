"""How many KV pages each KV group gets: the device memory left for the cache, and its split.

The budget is what the caller gives (``kv_cache_memory_bytes``) or, on a GPU, the free memory
minus (1 - utilization) x total, minus what else a step needs (``reserved_bytes``: activations
of the largest step and each attention backend's own buffers), minus the staging buffers of an
offloaded cache, minus 1 GiB of slack. CPU: 2 GiB. Sliding-window groups get exactly what
max_num_seqs windows need; the global group the rest.
"""

from __future__ import annotations

import torch

from infhip.runtime.attention.infinitehip import InfiniteHipBackend
from infhip.runtime.kv_cache import KVCacheManager, KVGroupSpec, OffloadSpec

GiB = 1 << 30


def reserved_bytes(config, max_num_seqs: int, max_num_batched_tokens: int, value_banks: bool = False) -> int:
    """Device memory besides KV pages: a few [T, hidden] / [T, 2I] float32 activations of the
    largest step, plus the InfiniteHiP backend's scratch and banks (value banks: offloading)."""
    cfg = config.model
    act = max_num_batched_tokens * (8 * cfg.hidden_size + 6 * cfg.intermediate_size) * 4
    if config.plan.infinitehip is not None:
        act += InfiniteHipBackend.reserved_bytes(config, max_num_seqs, value_banks)
    return act


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
