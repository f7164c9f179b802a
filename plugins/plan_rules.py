"""Dense-decode plan rules that both the runtime (runtime/cuda_graphs.py) and the dense plugin's AOT
enumeration (plugins/dense_attention.py) apply, stated once. No imports: a plugin reads them without
pulling in the runtime (plugins never import it), so the kernels compiled ahead of time are the
ones a step launches. A method's own rules live in its folder (InfiniteHiP's:
infhip/methods/infinitehip/rules.py).
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
