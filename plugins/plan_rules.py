"""Plan rules that both the runtime's planners and the plugins' AOT enumerations apply, stated
once. No imports: a plugin reads them without pulling in the runtime (plugins never import it),
and the runtime's planners (runtime/attention/infinitehip/planner.py, runtime/cuda_graphs.py)
call the same functions, so the kernels compiled ahead of time are the ones a step launches.

``cfg`` below is an InfiniteHipConfig (infhip/methods/infinitehip.py), read by attribute only.
"""

from __future__ import annotations

# -- dense decode: the short-context length buckets ------------------------------------------

DECODE_LEN_BUCKETS = (512, 2048, 8192)  # context-length bounds of the short-context dense graphs


def len_bucket(max_context: int) -> int | None:
    """The smallest bucket holding max_context, None past the largest (the start-up graphs).

        >>> len_bucket(300), len_bucket(513), len_bucket(10_000)
        (512, 2048, None)
    """
    return next((b for b in DECODE_LEN_BUCKETS if max_context <= b), None)


def reachable_len_buckets(max_seq_len: int) -> list[int]:
    """The buckets some context of at most max_seq_len tokens falls in (one above the previous)."""
    return [b for b, prev in zip(DECODE_LEN_BUCKETS, (0,) + DECODE_LEN_BUCKETS) if max_seq_len > prev]


# -- sparse contexts and KV offloading --------------------------------------------------------

def sparse_reachable(cfg, max_seq_len: int) -> bool:
    """Whether some context of an engine serving max_seq_len tokens goes sparse: it has
    InfiniteHiP layers (``cfg`` their knobs, None without) whose ``dense_threshold`` it reaches.
    Only such an engine keeps KV pages on the host when loaded with ``kv_offload_bytes``: pages
    move once a context passes its backend's offload window, which starts at the threshold
    (runtime/offload/policy.py). Read by the sparse launch space (plugins/infinitehip/_aot.py)
    and by the page copies' enumeration (plugins/kv_offload.py), which must not ask the former."""
    return cfg is not None and cfg.dense_threshold <= max_seq_len


# -- InfiniteHiP: stage-1 candidate capacity --------------------------------------------------

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


# -- InfiniteHiP: RoPE modes and the key bank -------------------------------------------------

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
