"""The dense attention backend: exact causal attention over the paged cache
(plugins/dense_attention.py), for every layer no registered backend claims and for the rows of
another backend's layer that stay dense.

Its public calls are what the other backends reuse for their dense rows (a sparse backend's short
requests, token drop's decode rows and non-dropping chunks):

* ``rope_and_write(layer, q, k, v, positions, slots)`` rotates q and k and writes k, v;
* ``decode(layer, q, out, block_tables, context_lens, max_len)`` — one query row per sequence;
* ``prefill(layer, q, k, v, block_tables, cu, ctx_lens, cu_list, ctx_lens_list)`` — packed
  chunks, causal over each sequence's cached context + chunk; returns [rows, Hq, D].

``run(layer, q, k, v, ctx, meta=None)`` is what a step launches for a dense layer; it reads only the
step's ForwardContext and the layer's PagedKV, so a CUDA graph captures it as is.
"""

from __future__ import annotations

import torch

from infhip.plugins.dense_attention import paged_decode_attention, paged_prefill_attention
from infhip.plugins.rope import rope_and_write_kv


class DenseBackend:
    """Not registered: it claims no layer, it is what every unclaimed layer runs (meta: none)."""

    name = "dense"

    def run(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx, meta=None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of the step's rows (decodes first) -> out [T, Hq, D]."""
        paging = ctx.groups[layer.kv_group]
        self.rope_and_write(layer, q, k, v, ctx.positions, paging.slot_mapping)
        out = torch.empty_like(q)
        nd, num_seqs = ctx.num_decodes, len(ctx.context_lens_list)
        if nd:
            self.decode(layer, q[:nd], out[:nd], paging.block_tables[:nd], ctx.context_lens[:nd], ctx.decode_len_bound)
        if nd < num_seqs:
            self.prefill_run(layer, q, k, v, out, ctx, nd, num_seqs)
        return out

    @staticmethod
    def rope_and_write(layer, q, k, v, positions: torch.Tensor, slots: torch.Tensor) -> None:
        rope = layer.rope[0]
        rope_and_write_kv(q, k, v, positions, rope.inv_freq, rope.attention_scaling, layer.kv, slots)

    @staticmethod
    def decode(layer, q: torch.Tensor, out: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, max_len: int | None) -> None:
        """Flash-decoding of q [B, Hq, D] into out [B, Hq, D]; context 0 reads nothing (padding,
        or rows another backend serves). max_len sizes the split count (cuda_graphs.decode_len_bound)."""
        paged_decode_attention(q, layer.kv, block_tables, context_lens, layer.scale, layer.window, out=out,
                               max_len=max_len)

    @staticmethod
    def prefill(layer, q, k, v, block_tables: torch.Tensor, cu: torch.Tensor, ctx_lens: torch.Tensor,
                cu_list: list[int], ctx_lens_list: list[int]) -> torch.Tensor:
        """Causal attention of packed chunks q [rows, Hq, D] (k/v: the same rows' fresh keys,
        already in the cache); sequence b owns rows cu[b]:cu[b+1], the last ones of its
        ctx_lens[b] tokens. Host lists and device tensors of the same values: no sync."""
        return paged_prefill_attention(q, layer.kv, block_tables, cu, ctx_lens, layer.scale, layer.window,
                                       k_new=k, v_new=v, cu_seqlens_q_list=cu_list,
                                       context_lens_list=ctx_lens_list)

    def prefill_run(self, layer, q, k, v, out, ctx, lo: int, hi: int) -> None:
        """The prefill chunks of sequences lo..hi-1 (batch order) of the step, into out."""
        cu, meta = ctx.cu_seqlens_q_list, ctx.groups[layer.kv_group]
        first, last = cu[lo], cu[hi]
        out[first:last] = self.prefill(
            layer, q[first:last], k[first:last], v[first:last], meta.block_tables[lo:hi],
            ctx.cu_seqlens_q[lo:hi + 1] - first, ctx.context_lens[lo:hi],
            [c - first for c in cu[lo:hi + 1]], ctx.context_lens_list[lo:hi])


DENSE = DenseBackend()
