"""Attention recall: how much of the dense attention probability mass a sparse key set keeps.

For query t of head h (dense, causal, exact softmax in float64)

    P[h, t, j] = softmax_j(scale * q_{t,h} . k_{j, g(h)}),   j <= pos_t
    recall[h]  = mean over t of  sum_{j in keep(t)} P[h, t, j]

1.0 means the sparse mask loses nothing; the paper (Fig. 6a) reports this per method. The keys
must carry the rotation the model uses (e.g. the cached, rotated keys). Measurement helper for
tests and benchmarks, plain torch (it materialises [Hq, Lq, Lk]).

    >>> import torch
    >>> q, k = torch.randn(3, 4, 8), torch.randn(10, 2, 8)
    >>> per_head, mean = attention_recall(q, k, torch.ones(3, 10, dtype=torch.bool), scale=0.35)
    >>> round(mean, 6)
    1.0
"""

from __future__ import annotations

import torch

from .blocks import block_key_mask


def attention_recall(q: torch.Tensor, keys: torch.Tensor, keep: torch.Tensor, *, scale: float,
                     q_positions: torch.Tensor | None = None,
                     k_positions: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """q [Lq, Hq, D], keys [Lk, Hkv, D] (all keys of the sequence), keep one of
        bool [Lq, Lk] or [Hq, Lq, Lk]   the kept keys of each query (and head)
        int  [Lq, n]                    kept key indices per query (entries outside [0, Lk),
                                        e.g. PAD, are ignored)
    Positions default to keys 0..Lk-1 and the queries being the newest Lq tokens.
    Returns (recall per q head float64 [Hq], mean over heads as a float)."""
    Lq, Hq, D = q.shape
    Lk, Hkv = keys.shape[:2]
    qp = q_positions if q_positions is not None else torch.arange(Lk - Lq, Lk, device=q.device)
    kp = k_positions if k_positions is not None else torch.arange(Lk, device=q.device)
    if not keep.dtype == torch.bool:
        idx = keep.long()
        ok = (idx >= 0) & (idx < Lk)
        mask = torch.zeros(Lq, Lk, dtype=torch.bool, device=q.device)
        rows = torch.arange(Lq, device=q.device)[:, None].expand_as(idx)
        mask[rows[ok], idx[ok]] = True
        keep = mask
    k = keys.double().repeat_interleave(Hq // Hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    causal = kp[None, :].long() <= qp[:, None].long()  # [Lq, Lk]
    probs = torch.softmax(scores.masked_fill(~causal[None], -torch.inf), dim=-1)
    kept = (probs * keep.expand(Hq, Lq, Lk).to(probs.dtype)).sum(-1)  # [Hq, Lq]
    per_head = kept.mean(dim=1)
    return per_head, per_head.mean().item()


def per_query_key_mask(selected: torch.Tensor, q_lens: torch.Tensor, ends: torch.Tensor,
                       n_sink: int, n_stream: int, num_keys: int) -> torch.Tensor:
    """bool [sum(q_lens), num_keys]: the InfiniteHiP key set of every query of one sequence's
    blocks (in block order), ready for `attention_recall` (which applies the causal cut)."""
    masks = block_key_mask(selected, ends, n_sink, n_stream, num_keys)  # [NB, num_keys]
    return masks.repeat_interleave(q_lens.long(), dim=0)
