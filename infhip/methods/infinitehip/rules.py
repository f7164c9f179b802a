"""InfiniteHiP's plan rules, stated once: its runtime planner and its backend's memory
(infhip/methods/infinitehip/runtime/) and its kernels' AOT launch space
(plugins/infinitehip/_aot.py) call the same functions, so the kernels compiled ahead of time are
the ones a step launches. No imports (torch-free, plugin-free): ``cfg`` below is an
InfiniteHipConfig (knobs.py), read by attribute only.
"""

from __future__ import annotations

# -- sparse contexts and KV offloading ------------------------------------------------------

def sparse_reachable(cfg, max_seq_len: int) -> bool:
    """Whether some context of an engine serving max_seq_len tokens goes sparse: it has
    InfiniteHiP layers (``cfg`` their knobs, None without) whose ``dense_threshold`` it reaches.
    Only such an engine keeps KV pages on the host when loaded with ``kv_offload_bytes``: pages
    move once a context passes its backend's offload window, which starts at the threshold
    (runtime/offload/policy.py). Read by the sparse launch space (plugins/infinitehip/_aot.py)
    and by the method's ``moves_pages`` (the page copies' enumeration, plugins/kv_offload.py)."""
    return cfg is not None and cfg.dense_threshold <= max_seq_len


# -- query tiles that fit shared memory ------------------------------------------

# SelectRep (plugins/infinitehip/pruning.py) scores a block's chunks with one query tile of
# next_pow2(block_q / stride * G) rows (G query heads per kv head) x next_pow2(head_dim); under
# relative pruning RoPE it holds two such tiles (each branch's rotation). At 64K elements, GQA
# groups of 7-8 at head_dim 128 (Qwen2.5-7B) or 4 at 256 (Gemma-3-270m) with stride 1, that took
# 270-280 KB of shared memory (Triton 3.6 and 3.9), over an sm_90 block's 227 KB: it could not
# launch. Half of it (stride 2) takes ~140 KB.
MAX_RELATIVE_TILE = 32768  # query-tile elements (rows x head dims) under relative pruning RoPE


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def query_tile(block_q: int, stride: int, group: int, head_dim: int) -> int:
    """Elements of SelectRep's query tile (as pruning.py's _tiling sizes it)."""
    return max(16, _pow2(-(-block_q // stride) * group)) * max(16, _pow2(head_dim))


def fitting_query_strides(cfg, group: int, head_dim: int) -> tuple[int, ...]:
    """``cfg.query_strides`` with each stage's stride doubled until its query tile fits
    MAX_RELATIVE_TILE, where some layer prunes with relative RoPE (no change otherwise, or for
    models whose tiles already fit: every model measured for quality so far).

        >>> from types import SimpleNamespace as NS
        >>> cfg = NS(query_strides=(4, 4, 1), pruning_rope="relative", special_pruning_rope="chunk_indexed",
        ...          stages=(NS(block_q=64),))
        >>> fitting_query_strides(cfg, 7, 128), fitting_query_strides(cfg, 7, 64)
        ((4, 4, 2), (4, 4, 1))
    """
    if "relative" not in (cfg.pruning_rope, cfg.special_pruning_rope):
        return tuple(cfg.query_strides)
    block_q = cfg.stages[0].block_q
    strides = []
    for s in cfg.query_strides:
        while s < block_q and query_tile(block_q, s, group, head_dim) > MAX_RELATIVE_TILE:
            s *= 2
        strides.append(s)
    return tuple(strides)


# -- stage-1 candidate capacity --------------------------------------------------

MIN_CAPACITY = 1024  # candidate_capacity: a power of two >= 1024


def candidate_capacity(end: int, n_sink: int, n_stream: int) -> int:
    """Stage-1 candidate capacity for contexts up to ``end`` tokens: the middle (neither sink
    nor stream) rounded up to a power of two >= 1024, so that it, and with it the kernels' grid
    and a CUDA graph's key, changes only when the context doubles.

        >>> candidate_capacity(100, 4, 8), candidate_capacity(5000, 256, 1024)
        (1024, 4096)
    """
    middle = max(0, max(min(n_sink, end), end - n_stream) - n_sink)
    return 1 << max(MIN_CAPACITY.bit_length() - 1, (middle - 1).bit_length())


# -- RoPE modes and the key bank -------------------------------------------------

def step_dynamic_rope(cfg, max_sparse_end: int, trained_window: int) -> bool:
    """Whether a step whose longest sparse context is max_sparse_end tokens applies the dynamic
    RoPE styles: always unless ``rope_off_in_trained_window``, else only past the trained window."""
    return not cfg.rope_off_in_trained_window or max_sparse_end > trained_window


def static_rope_possible(cfg, max_seq_len: int, trained_window: int) -> bool:
    """Whether some sparse step runs with stored rotations only (a sparse context fits the window)."""
    return cfg.rope_off_in_trained_window and cfg.dense_threshold <= min(trained_window, max_seq_len)


def dynamic_rope_possible(cfg, max_seq_len: int, trained_window: int) -> bool:
    """Whether some sparse step of an engine serving max_seq_len tokens applies dynamic RoPE."""
    return not cfg.rope_off_in_trained_window or max_seq_len > trained_window


def rope_modes(cfg, max_seq_len: int, trained_window: int) -> list[tuple[bool, int, int]]:
    """(dynamic, lo, hi): each RoPE mode a sparse step can run in and the range of its longest
    sparse context (static first)."""
    modes = []
    if static_rope_possible(cfg, max_seq_len, trained_window):
        modes.append((False, cfg.dense_threshold, min(trained_window, max_seq_len)))
    if not cfg.rope_off_in_trained_window:
        modes.append((True, cfg.dense_threshold, max_seq_len))
    elif max_seq_len > trained_window:
        modes.append((True, max(trained_window + 1, cfg.dense_threshold), max_seq_len))
    return modes


def uses_key_bank(cfg, max_seq_len: int, trained_window: int, mask_layout: str = "shared") -> bool:
    """Whether the layers keep a rotated key bank: it serves the streaming attention style, and
    only steps with dynamic RoPE read it, so a runner whose sequences all fit the trained window
    (with ``rope_off_in_trained_window``) does not spend the memory. It holds one selection per
    block: the shared mask layout only."""
    return (cfg.key_bank and cfg.attention_rope == "streaming" and mask_layout == "shared"
            and dynamic_rope_possible(cfg, max_seq_len, trained_window))
