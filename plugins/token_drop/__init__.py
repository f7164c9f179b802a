"""UniPrefill token dropping (paper 004): block importance at anchor layers, on-device top-p
block selection, and compaction / reconstitution of the packed batch.

    scores, cu_blocks = block_importance(q, k, cu_seqlens, scale, obs_window=128, block_size=64)
    sel = top_p_select(scores, cu_blocks, cu_seqlens, 0.99, num_tokens=T, max_seqlen=max_len)
    cb = compact_batch(sel, positions)           # one host read: the kept counts
    h_small = gather_rows(h, cb.idx)             # ... sublayers until the next anchor ...
    h = reconstitute(h_before, h_small, cb.idx)  # dropped rows keep their pre-drop state
"""

from .gather import (CompactBatch, compact_batch, gather_rows, reconstitute, reconstitute_ref,
                     scatter_rows_, token_positions)
from .importance import block_importance, block_importance_ref, block_importance_triton, block_layout
from .top_p import (TokenSelection, descending_sort_keys, force_retention, select_ref, select_triton,
                    top_p_select)

__all__ = [
    "CompactBatch", "TokenSelection", "block_importance", "block_importance_ref",
    "block_importance_triton", "block_layout", "compact_batch", "descending_sort_keys",
    "force_retention", "gather_rows", "reconstitute", "reconstitute_ref", "scatter_rows_",
    "select_ref", "select_triton", "token_positions", "top_p_select",
]
