"""Compaction and reconstitution of a packed batch around a UniPrefill drop (paper 004 §3.4).

After an anchor layer keeps rows idx (ascending, packed per sequence by cu_kept), every later
sublayer runs on the compact batch

    h_compact = h[idx]                                   [M, H]
    positions_compact = positions[idx]                   original positions (RoPE, sliding windows)
    cu_seqlens_compact = cu_kept                         [B + 1]

and at the next anchor the full batch is reconstituted: kept rows take the propagated values,
dropped rows keep their value from before the drop (Eq. 8):

    h_next[t] = h_compact[slot(t)]  if t was kept,  else  h_prev[t]

Plain torch index ops (index_select / index_copy_): a row gather or scatter is a pure copy,
memory bound, and these are single vectorised kernels on the GPU already; a Triton version
would only duplicate them. Indices are always rows of the full batch, since importance is
re-estimated on the reconstituted sequence at each anchor (drops never nest).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .top_p import TokenSelection


@dataclass
class CompactBatch:
    """The compact batch that runs the sublayers between two anchors."""

    idx: torch.Tensor  # [M] int64: rows of the full batch, ascending
    positions: torch.Tensor  # [M]: original positions of the kept tokens
    cu_seqlens: torch.Tensor  # [B + 1] int32: the compact batch's sequence offsets
    cu_seqlens_list: list[int]  # host copy, for attention planners
    num_tokens: int  # M


def token_positions(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Position of each packed row inside its sequence ([T] int32; rows past cu_seqlens[-1]: garbage)."""
    rows = torch.arange(num_tokens, dtype=torch.int32, device=cu_seqlens.device)
    seq = torch.searchsorted(cu_seqlens, rows, right=True) - 1
    return rows - cu_seqlens[seq.clamp(0, cu_seqlens.numel() - 2)]


def compact_batch(selection: TokenSelection, positions: torch.Tensor | None = None,
                  cu_seqlens: torch.Tensor | None = None) -> CompactBatch:
    """Index, positions and offsets of the compact batch. One deliberate host read: the kept
    counts (cu_kept), which size every downstream launch.

    positions [T] are the full batch's positions (chunked prefill: offset by earlier context);
    without them cu_seqlens gives positions from 0 in each sequence.

    >>> from infhip.plugins.token_drop.top_p import top_p_select
    >>> cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    >>> sel = top_p_select(torch.tensor([0.9, 0.1, 0.0, 0.2, 0.8]), torch.tensor([0, 3, 5], dtype=torch.int32),
    ...                    cu, 0.5, num_tokens=10, max_seqlen=6, block_size=2, num_sink=0, obs_window=1)
    >>> cb = compact_batch(sel, cu_seqlens=cu)
    >>> cb.idx.tolist(), cb.positions.tolist(), cb.cu_seqlens_list
    ([0, 1, 5, 8, 9], [0, 1, 5, 2, 3], [0, 3, 5])
    """
    cu_list = selection.cu_kept.tolist()  # the host read
    idx = selection.kept_idx[:cu_list[-1]].long()
    if positions is None:
        assert cu_seqlens is not None, "give positions or cu_seqlens"
        positions = token_positions(cu_seqlens, selection.keep_mask.numel())
    assert positions.shape == selection.keep_mask.shape, "positions must be [T]"
    return CompactBatch(idx, positions.index_select(0, idx), selection.cu_kept, cu_list, cu_list[-1])


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Kept rows of x [T, ...] -> [M, ...] (contiguous)."""
    assert idx.dim() == 1 and idx.dtype in (torch.int32, torch.int64)
    return x.index_select(0, idx)


def scatter_rows_(full: torch.Tensor, compact: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """In place: full[idx] = compact; the other rows keep their values. Returns full."""
    assert compact.shape[0] == idx.shape[0] and compact.shape[1:] == full.shape[1:]
    assert compact.dtype == full.dtype
    return full.index_copy_(0, idx.long(), compact)


def reconstitute(prev: torch.Tensor, compact: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Out of place: a copy of prev [T, ...] with rows idx replaced by compact [M, ...]."""
    return scatter_rows_(prev.clone(), compact, idx)


def reconstitute_ref(prev: torch.Tensor, compact: torch.Tensor, keep_mask: torch.Tensor) -> torch.Tensor:
    """Reference by mask: row t is the next compact row if keep_mask[t], else prev[t]."""
    out = prev.clone()
    out[keep_mask] = compact
    return out


def aot_launches(space) -> None:
    """Nothing to compile: compaction and reconstitution are torch index ops (no Triton kernel)."""
    return None
