"""InfiniteHiP plugins (paper 000, SPEC section 4): hierarchical pruning stages and block-sparse
attention over the paged KV cache, plus a recall measurement.

    blocks.py            query blocks, key sets (sink | selected middle | stream), PAD, mask layouts
    pruning.py           SelectRep pruning stage: Triton kernel + topk (pruning_ref.py: torch)
    raw_keys.py          keys un-rotated once per prefill step, for the dynamic RoPE styles
    sparse_attention.py  block-sparse decode (split-K) and prefill (flash-style) + torch reference
    key_bank.py          selected keys rotated to their rank once per refresh (cached decode steps)
    rope_styles.py       dynamic RoPE: none | relative | chunk_indexed | streaming
    recall.py            fraction of dense attention mass a key set keeps

Dispatch: `pruning_stage` and the sparse attention entry points launch Triton on CUDA tensors
(and on CPU tensors under TRITON_INTERPRET=1, as the tests do); other CPU tensors take the
torch references (pruning_ref.py, sparse_attention_ref), same contract. The runtime wires them
in infhip/methods/infinitehip/runtime/.

A decode step with the "3k" stages, without mask caching:

    >>> sel, n = None, None                                                    # doctest: +SKIP
    >>> for l_c, k in ((256, 32768), (32, 8192), (8, 2048)):                   # doctest: +SKIP
    ...     sel, n = pruning_stage(q, k_cache, tables, q_start, q_lens, ends, sel, n,
    ...                            chunk_size=l_c, k=k, block_q=1, n_sink=256, n_stream=1024)
    >>> out = sparse_decode_attention(q, k_cache, v_cache, tables, context_lens, sel,  # doctest: +SKIP
    ...                               n_sink=256, n_stream=1024, scale=head_dim ** -0.5)
"""

from .blocks import (MASK_LAYOUTS, PAD, block_key_mask, initial_candidates, mask_heads, plan_query_blocks,
                     selected_range, stream_starts)
from .key_bank import write_key_bank, write_key_bank_ref
from .pruning import pruning_stage, select_rep_scores, topk_chunks
from .pruning_ref import pruning_stage_ref, select_rep_scores_ref, topk_chunks_ref
from .raw_keys import RawKeys, unrotate_keys
from .recall import attention_recall, per_query_key_mask
from .rope_styles import CHUNK_INDEXED, NONE, RELATIVE, STREAMING, rope_style_id, rotate_by_ref
from .sparse_attention import (block_sparse_attention, sparse_attention_ref, sparse_decode_attention,
                               sparse_prefill_attention)

__all__ = [
    "MASK_LAYOUTS", "mask_heads", "PAD", "block_key_mask", "initial_candidates", "plan_query_blocks", "selected_range",
    "stream_starts", "pruning_stage", "select_rep_scores", "topk_chunks", "pruning_stage_ref",
    "select_rep_scores_ref", "topk_chunks_ref", "RawKeys", "unrotate_keys", "attention_recall", "per_query_key_mask",
    "NONE", "RELATIVE", "CHUNK_INDEXED", "STREAMING", "rope_style_id", "rotate_by_ref",
    "block_sparse_attention", "sparse_attention_ref", "sparse_decode_attention", "sparse_prefill_attention",
    "write_key_bank", "write_key_bank_ref",
]
