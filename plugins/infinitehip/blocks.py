"""Query blocks and key sets: the vocabulary shared by the InfiniteHiP plugins.

Query blocks. Pruning and block-sparse attention both work per *query block*: up to b_q
consecutive queries of one sequence that share one key set. Queries stay packed as the
runtime holds them, q [T, Hq, D]; block i is described by four int32 tensors

    q_start[i]        first row of the block in q
    q_lens[i]         number of queries, 0..b_q (0 = padding block, nothing read or written)
    ends[i]           context end e: query t of the block sits at position e - q_lens[i] + t,
                      so the last one at e - 1 (decode: ends = context_lens, q_lens = 1)
    block_tables[i]   page-table row of the block's sequence ([NB, max_pages], rows may repeat)

Key set of a block with end e (n_sink, n_stream fixed per layer):

    sink      [0, min(n_sink, e))
    stream    [s, e),   s = max(min(n_sink, e), e - n_stream)
    middle    [n_sink, s): the pruning candidates; the last stage keeps a subset of them

and each query also masks the keys after its own position (causal). The last query of a
block therefore sees exactly what a decode step at context length e sees.

Index lists (candidates, stage outputs) are int32 [NB, n], ascending, padded at the end with
PAD = 2**31 - 1 so that every row stays sorted and `torch.searchsorted` applies. Entries that
fall outside the middle (a mask cached while the stream window moved on) are ignored by the
attention kernels, so no key is ever counted twice.

    >>> import torch
    >>> q_start, q_lens, ends, seq = plan_query_blocks([5], [12], block_q=4)
    >>> q_lens.tolist(), ends.tolist()
    ([4, 1], [11, 12])
    >>> initial_candidates(torch.tensor([12], dtype=torch.int32), n_sink=2, n_stream=4)[0].tolist()
    [[2, 3, 4, 5, 6, 7]]
"""

from __future__ import annotations

import torch

PAD = 2**31 - 1  # padding of sorted index rows (int32 max)

# Mask layouts: how many chunk selections a query block keeps. "shared": one for all heads (chunk
# score = max over heads; index rows [NB, n], today's runtime layout); "kv_head": one per kv head
# (score = max over the head's GQA group, which shares those keys); "q_head": one per query head,
# each with its own budget k (hip-attention v1_2's indices_left [BSZ, BDST, HEAD, chunks]).
# Per-head index rows are [NB, H, n] with H = mask_heads(...).
MASK_LAYOUTS = ("shared", "kv_head", "q_head")


def mask_heads(mask_layout: str, num_q_heads: int, num_kv_heads: int) -> int:
    """Selections per query block of a layout: shared 1, kv_head Hkv, q_head Hq.

        >>> mask_heads("kv_head", 14, 2), mask_heads("q_head", 14, 2), mask_heads("shared", 14, 2)
        (2, 14, 1)
    """
    if mask_layout not in MASK_LAYOUTS:
        raise ValueError(f"mask_layout must be one of {MASK_LAYOUTS}, got {mask_layout!r}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    return {"shared": 1, "kv_head": num_kv_heads, "q_head": num_q_heads}[mask_layout]


def per_head_rows(candidates, cand_lens, num_heads: int):
    """Candidates of a per-head layout: [NB, n] rows (one list for every head, e.g. the middle)
    broadcast to [NB, H, n] (lens [NB] -> [NB, H]); [NB, H, n] rows pass through."""
    if candidates.dim() == 2:
        return (candidates[:, None].expand(-1, num_heads, -1),
                cand_lens[:, None].expand(-1, num_heads))
    if candidates.shape[1] != num_heads or cand_lens.shape != candidates.shape[:2]:
        raise ValueError(f"per-head candidates must be [NB, {num_heads}, n] with lens [NB, {num_heads}], got "
                         f"{tuple(candidates.shape)} and {tuple(cand_lens.shape)}")
    return candidates, cand_lens


def plan_query_blocks(q_lens_per_seq: list[int], context_lens: list[int], block_q: int,
                      device: torch.device | str = "cpu"):
    """Cut each sequence's q_len newest queries (packed in order) into blocks of block_q, aligned
    from the sequence's first query. Returns int32 (q_start, q_lens, ends, seq_ids) of [NB];
    the caller passes block_tables[seq_ids] to the kernels.

        >>> [x.tolist() for x in plan_query_blocks([5], [9], 4)[:2]]
        [[0, 4], [4, 1]]
    """
    starts, lens, ends, seqs = [], [], [], []
    row = 0
    for b, (q_len, ctx) in enumerate(zip(q_lens_per_seq, context_lens)):
        assert 0 <= q_len <= ctx, f"sequence {b}: {q_len} queries for {ctx} tokens of context"
        for first in range(0, q_len, block_q):
            n = min(block_q, q_len - first)
            starts.append(row + first)
            lens.append(n)
            ends.append(ctx - q_len + first + n)
            seqs.append(b)
        row += q_len
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    return as_i32(starts), as_i32(lens), as_i32(ends), as_i32(seqs)


def stream_starts(ends: torch.Tensor, n_sink: int, n_stream: int) -> torch.Tensor:
    """s = max(min(n_sink, e), e - n_stream) per block: first streaming token (int32 [NB])."""
    e = ends.long()
    return torch.maximum(e.clamp(max=n_sink), e - n_stream).to(torch.int32)


def initial_candidates(ends: torch.Tensor, n_sink: int, n_stream: int,
                       width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Explicit stage-1 candidates: the middle [n_sink, s) of every block, PAD-padded to `width`
    (default: the longest row). Returns (int32 [NB, width], lens int32 [NB]). The pruning kernel
    does not need this (it walks the range implicitly); tests and references do."""
    lens = (stream_starts(ends, n_sink, n_stream).long() - n_sink).clamp(min=0)
    width = int(lens.max().item()) if width is None else width
    idx = torch.arange(width, device=ends.device)
    cand = torch.where(idx[None, :] < lens[:, None], n_sink + idx[None, :], PAD)
    return cand.to(torch.int32), lens.to(torch.int32)


def selected_range(selected: torch.Tensor, ends: torch.Tensor, n_sink: int, n_stream: int):
    """Entries [begin, end) of each sorted, PAD-padded row of `selected` that fall inside the
    block's middle [n_sink, s): int32 (begin [NB], end [NB]). Pure tensor ops (no host sync)."""
    s = stream_starts(ends, n_sink, n_stream)
    lo = torch.full_like(s, n_sink)[:, None]
    begin = torch.searchsorted(selected, lo.to(selected.dtype))[:, 0]
    end = torch.searchsorted(selected, s[:, None].to(selected.dtype))[:, 0]
    return begin.to(torch.int32), torch.maximum(begin, end).to(torch.int32)


def block_key_mask(selected: torch.Tensor, ends: torch.Tensor, n_sink: int, n_stream: int,
                   num_keys: int) -> torch.Tensor:
    """bool [NB, num_keys]: the key set of every block (sink | selected middle | stream), before
    the per-query causal cut. A readable reference for tests and recall."""
    NB = ends.shape[0]
    pos = torch.arange(num_keys, device=ends.device)[None, :]
    e = ends.long()[:, None]
    s = stream_starts(ends, n_sink, n_stream).long()[:, None]
    mask = (pos < torch.clamp(e, max=n_sink)) | ((pos >= s) & (pos < e))
    sel = selected.long()
    keep = (sel >= n_sink) & (sel < s) & (sel < num_keys)
    rows = torch.arange(NB, device=ends.device)[:, None].expand_as(sel)
    mask[rows[keep], sel[keep]] = True
    return mask
