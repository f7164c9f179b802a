"""Prefill attention of the kept queries of one sequence after a UniPrefill drop.

After a drop the queries of a prefill chunk are a subset of its positions (kept blocks, sinks,
window), and at a sliding-window layer so are its new keys. The paged prefill kernel assumes
the queries are the last rows of a contiguous context, so these rows take this path instead:

    q [Mq, Hq, D] at positions q_pos (ascending), k/v [Mk, Hkv, D] at positions k_pos (ascending)
    out[i] = softmax_j(scale q_i . k_j) v_j  over keys with k_pos[j] <= q_pos[i]
                                              (and k_pos[j] > q_pos[i] - window)

The queries are cut into *runs* of consecutive positions (kept tokens come in whole blocks of G,
so runs are long), at most `_MAX_RUN` rows each. A run whose visible keys are a contiguous range
of positions ending at its own last position (every full-attention anchor: all of the
sequence's keys are there) needs no mask: SDPA with a lower-right causal bias, which the fused
GPU kernels take. Other runs (a sliding layer, whose new keys have gaps) get an explicit boolean
mask of [run, keys in reach] (at most _MAX_RUN x (_MAX_RUN + window)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

_MAX_RUN = 1024  # query rows per SDPA call (bounds the explicit masks)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # [L, H, D] -> [1, H, L, D]


def query_runs(q_pos: torch.Tensor, max_run: int = _MAX_RUN) -> list[tuple[int, int]]:
    """[(i0, i1)] row ranges of q_pos (host int64, ascending) with consecutive positions.

    >>> query_runs(torch.tensor([0, 1, 2, 7, 8, 10]), max_run=2)
    [(0, 2), (2, 3), (3, 5), (5, 6)]
    """
    n = q_pos.numel()
    if n == 0:
        return []
    breaks = (torch.nonzero(q_pos[1:] - q_pos[:-1] != 1).flatten() + 1).tolist()
    runs = []
    for i0, i1 in zip([0] + breaks, breaks + [n]):
        runs += [(s, min(s + max_run, i1)) for s in range(i0, i1, max_run)]
    return runs


def kept_attention(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   k_pos: torch.Tensor, scale: float, window: int | None = None,
                   max_run: int = _MAX_RUN) -> torch.Tensor:
    """Causal (optionally windowed) attention of queries at positions q_pos over keys at k_pos.

    q_pos / k_pos are host int64 tensors (they choose slices); every query must see its own
    position among the keys (a kept query always wrote its key). Returns [Mq, Hq, D].
    """
    assert q_pos.device.type == "cpu" and k_pos.device.type == "cpu", "positions are host tensors"
    assert q.shape[0] == q_pos.numel() and k.shape[0] == k_pos.numel() == v.shape[0]
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for i0, i1 in query_runs(q_pos, max_run):
        first, last = int(q_pos[i0]), int(q_pos[i1 - 1])
        hi = int(torch.searchsorted(k_pos, last, right=True))
        lo = int(torch.searchsorted(k_pos, first - window + 1)) if window else 0
        assert hi > lo and int(k_pos[hi - 1]) == last, f"query at position {last} has no key of its own"
        contiguous = int(k_pos[lo]) == last - (hi - lo - 1)
        uncut = not window or last - int(k_pos[lo]) < window  # no key leaves any query's window
        qs = _heads_first(q[i0:i1])
        if contiguous and uncut:
            o = F.scaled_dot_product_attention(
                qs, _heads_first(k[lo:hi]), _heads_first(v[lo:hi]),
                attn_mask=causal_lower_right(i1 - i0, hi - lo), scale=scale, enable_gqa=True)
        else:
            qp, kp = q_pos[i0:i1, None], k_pos[None, lo:hi]
            mask = kp <= qp
            if window:
                mask &= kp > qp - window
            # heads expanded by hand: SDPA with a mask and enable_gqa falls back to the math kernel
            o = F.scaled_dot_product_attention(
                qs, _heads_first(k[lo:hi].repeat_interleave(group, dim=1)),
                _heads_first(v[lo:hi].repeat_interleave(group, dim=1)),
                attn_mask=mask.to(q.device), scale=scale)
        out[i0:i1] = o[0].transpose(0, 1)
    return out


__all__ = ["kept_attention", "query_runs"]
