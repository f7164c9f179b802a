"""Plain-torch float64 reference of the InfiniteHiP pruning stage (pruning.py has the math).

Written for reading, not speed: per query block it scores *every* candidate against the block's
queries (sigma tables, one per SelectRep branch since RELATIVE RoPE puts the two branches at
different positions), then replays the tournament on those tables and picks the top chunks by
sorting in Python. Per-head layouts (blocks.MASK_LAYOUTS) run the same tournament per mask
head, on that head's q heads and kv head only, and keep each head's own top chunks. It also
reports, per chunk, the smallest |sigma_right - sigma_left| seen in the tournament, so tests can
tell genuine disagreements from float32-vs-float64 near-ties.
"""

from __future__ import annotations

import math

import torch

from ..kv_offload import merged_kv
from ..kv_quant import check_kv_scales, read_rows
from .blocks import PAD, initial_candidates, mask_heads, per_head_rows
from .rope_styles import CHUNK_INDEXED, NONE, RELATIVE, rope_style_id, rotate_by_ref


def _sigma_tables(q_rows, q_pos, keys, toks, chunk_of, num_chunks, n_stream, style, inv_freq):
    """sigma for every candidate and kv head, as the left and as the right representative:
    2 x float64 [Hkv, n]. q_rows [L, Hq, D], keys [n, Hkv, D], toks [n] original positions."""
    Hq, Hkv = q_rows.shape[1], keys.shape[1]
    if style == RELATIVE:
        q_new, key_new = torch.full_like(q_pos, n_stream + 1), (torch.zeros_like(toks), torch.ones_like(toks))
    elif style == CHUNK_INDEXED:
        q_new, key_new = q_pos.clamp(max=num_chunks + n_stream), (chunk_of, chunk_of)
    else:
        q_new, key_new = q_pos, (toks, toks)
    q = rotate_by_ref(q_rows, q_new - q_pos, inv_freq) if style != NONE else q_rows.double()
    tables = []
    for k_pos in key_new:
        k = rotate_by_ref(keys, k_pos - toks, inv_freq) if style != NONE else keys.double()
        k = k.repeat_interleave(Hq // Hkv, dim=1)  # [n, Hq, D]
        s = torch.einsum("thd,nhd->htn", q, k)  # [Hq, L, n]
        s = s.masked_fill(toks[None, None, :] > q_pos[None, :, None], -math.inf)  # causal
        tables.append(s.amax(dim=1).view(Hkv, Hq // Hkv, -1).amax(dim=1))  # [Hkv, n]
    return tables


def _tournament(q_rows, q_pos, keys, toks, chunk_size, n_stream, style, inv_freq):
    """SelectRep over the n candidates toks [n] of one block: q_rows [L, Hq', D] score the kv heads
    of keys [n, Hkv', D] (each kv head by the max over its Hq' / Hkv' q heads). Returns float64
    (win [Hkv', nc] the winners' sigma, first long [Hkv', nc] their offsets in the chunk, gaps
    [Hkv', nc] the smallest |sigma_right - sigma_left| of each tournament)."""
    n, Hkv = toks.numel(), keys.shape[1]
    nc = math.ceil(n / chunk_size)
    left, right = _sigma_tables(q_rows, q_pos, keys, toks, torch.arange(n) // chunk_size, nc,
                                n_stream, style, inv_freq)
    pad = nc * chunk_size - n  # the short last chunk: its missing tail never wins
    left = torch.nn.functional.pad(left, (0, pad), value=-math.inf)
    right = torch.nn.functional.pad(right, (0, pad), value=-math.inf)
    base = torch.arange(nc) * chunk_size  # [nc]
    first = torch.zeros(Hkv, nc, dtype=torch.long)
    gaps = torch.full((Hkv, nc), math.inf, dtype=torch.float64)
    win = left[:, base]  # sigma of the current range's first candidate
    half = chunk_size
    while half > 1:
        half //= 2
        s_left = left.gather(1, base + first) if style == RELATIVE else win
        s_right = right.gather(1, base + first + half)
        has_right = first + half < n - base  # right half starts inside the chunk
        s_right = torch.where(has_right, s_right, -math.inf)
        gaps = torch.minimum(gaps, torch.where(has_right, (s_right - s_left).abs(), math.inf))
        first = torch.where(s_right > s_left, first + half, first)
        win = torch.maximum(s_left, s_right)
    return win, base + first, gaps


def select_rep_scores_ref(q, k_cache, block_tables, q_start, q_lens, ends, candidates=None,
                          cand_lens=None, *, chunk_size: int, n_sink: int, n_stream: int,
                          max_candidates: int | None = None, rope_style="none", inv_freq=None,
                          head_normalized: bool = False, query_stride: int = 1, k_scale=None, offload=None,
                          mask_layout: str = "shared"):
    """Reference of pruning.select_rep_scores: (scores float64, reps int32, margins float64 = the
    smallest |sigma_right - sigma_left| of each tournament).
    mask_layout "shared" (blocks.MASK_LAYOUTS): scores [NB, C] = max over kv heads, reps / margins
    [NB, Hkv, C]; head_normalized: each kv head's chunk scores minus that head's best, then the max.
    "kv_head" / "q_head": one tournament and score row per mask head m (H = Hkv / Hq; m scores with
    its q heads [m Hq/H, (m+1) Hq/H) against kv head m Hq/H // (Hq/Hkv)): scores, reps and margins
    [NB, H, C]; candidates [NB, n] (every head) or [NB, H, n] with lens [NB, H]; head_normalized
    changes no ranking of one head and is not applied.
    query_stride s: only the block's queries min(s (i + 1) - 1, q_len - 1) score. k_scale: an
    fp8 k_cache's row scales (its keys dequantized to float32 rows).
    offload: host twin of the cache; table entries < 0 name its pages (kv_offload.py)."""
    k_cache, _, k_scale, _, block_tables = merged_kv(k_cache, None, k_scale, None, block_tables, offload)
    scaled = check_kv_scales(k_cache, None, k_scale, None)
    style = rope_style_id(rope_style)
    NB, Hq, Hkv, page = ends.shape[0], q.shape[1], k_cache.shape[2], k_cache.shape[1]
    H = mask_heads(mask_layout, Hq, Hkv)
    per_head = mask_layout != "shared"
    if candidates is None:
        candidates, cand_lens = initial_candidates(ends, n_sink, n_stream, width=max_candidates)
    elif cand_lens is None:
        cand_lens = (candidates != PAD).sum(-1)
    if per_head:
        candidates, cand_lens = per_head_rows(candidates, cand_lens, H)
    C = math.ceil(candidates.shape[-1] / chunk_size)
    heads = H if per_head else Hkv  # rows of reps / margins per block
    scores = torch.full((NB, H, C) if per_head else (NB, C), -math.inf, dtype=torch.float64)
    reps = torch.full((NB, heads, C), PAD, dtype=torch.int32)
    margins = torch.full((NB, heads, C), math.inf, dtype=torch.float64)
    freq = inv_freq.cpu() if inv_freq is not None else None
    Gs = Hq // H if per_head else Hq  # q heads per selection
    for i in range(NB):
        q_len, e = int(q_lens[i]), int(ends[i])
        if q_len == 0:
            continue
        sampled = torch.arange(query_stride - 1, q_len - 1 + query_stride, query_stride).clamp(max=q_len - 1)
        q_rows = q[int(q_start[i]):int(q_start[i]) + q_len].cpu()[sampled]  # [L, Hq, D]
        q_pos = torch.arange(e - q_len, e)[sampled]
        for m in range(H if per_head else 1):
            row, n = (candidates[i, m], int(cand_lens[i, m])) if per_head else (candidates[i], int(cand_lens[i]))
            if n == 0:
                continue
            toks = row[:n].long().cpu()
            pages, slots = block_tables[i, toks // page].long(), (toks % page).to(block_tables.device)
            keys = read_rows(k_cache, k_scale, pages, slots, torch.float32 if scaled else k_cache.dtype).cpu()
            qs = q_rows
            if per_head:  # this selection's q heads and their kv head
                kv = m * Gs // (Hq // Hkv)
                qs, keys = q_rows[:, m * Gs:(m + 1) * Gs], keys[:, kv:kv + 1]
            win, first, gaps = _tournament(qs, q_pos, keys, toks, chunk_size, n_stream, style, freq)
            nc = win.shape[1]
            if per_head:
                scores[i, m, :nc], reps[i, m, :nc], margins[i, m, :nc] = win[0], toks[first[0]].to(torch.int32), gaps[0]
                continue
            if head_normalized:
                best = win.amax(dim=1, keepdim=True)
                win = torch.where(best > -math.inf, win - best, win)
            scores[i, :nc] = win.amax(dim=0)
            reps[i, :, :nc] = toks[first].to(torch.int32)
            margins[i, :, :nc] = gaps
    return scores, reps, margins


def topk_chunks_ref(scores, candidates, cand_lens, *, chunk_size: int, k: int, n_sink: int):
    """Reference of pruning.topk_chunks by sorting in Python (ties: lower chunk index first)."""
    NB = scores.shape[0]
    out = torch.full((NB, k), PAD, dtype=torch.int32)
    lens = torch.zeros(NB, dtype=torch.int32)
    for i in range(NB):
        n = int(cand_lens[i])
        nc = math.ceil(n / chunk_size)
        best = sorted(range(nc), key=lambda c: (-float(scores[i, c]), c))[:k // chunk_size]
        toks = [j for c in sorted(best) for j in range(c * chunk_size, min((c + 1) * chunk_size, n))]
        if candidates is not None:
            toks = [int(candidates[i, j]) for j in toks]
        else:
            toks = [n_sink + j for j in toks]
        out[i, :len(toks)] = torch.tensor(toks, dtype=torch.int32)
        lens[i] = len(toks)
    return out, lens


def pruning_stage_ref(q, k_cache, block_tables, q_start, q_lens, ends, candidates=None,
                      cand_lens=None, *, chunk_size: int, k: int, n_sink: int, n_stream: int,
                      max_candidates: int | None = None, rope_style="none", inv_freq=None,
                      head_normalized: bool = False, query_stride: int = 1, k_scale=None, offload=None,
                      reduce_scores=None, mask_layout: str = "shared"):
    """Reference of pruning.pruning_stage: survivors int32 PAD-padded and their counts int32;
    "shared": [NB, k] and [NB]; "kv_head" / "q_head" (select_rep_scores_ref): [NB, H, k] and
    [NB, H], each head's own top k / l_c chunks (the budget k is per head).
    k_scale: an fp8 k_cache's row scales.
    offload: host twin of the cache; table entries < 0 name its pages (kv_offload.py).

        >>> sel, n = pruning_stage_ref(q, k_cache, tables, q_start, q_lens, ends,  # doctest: +SKIP
        ...                            chunk_size=8, k=64, n_sink=4, n_stream=8, mask_layout="q_head")
    """
    if candidates is None:
        candidates, cand_lens = initial_candidates(ends, n_sink, n_stream, width=max_candidates)
    elif cand_lens is None:
        cand_lens = (candidates != PAD).sum(-1)
    scores, _, _ = select_rep_scores_ref(q, k_cache, block_tables, q_start, q_lens, ends, candidates,
                                         cand_lens, chunk_size=chunk_size, n_sink=n_sink,
                                         n_stream=n_stream, rope_style=rope_style, inv_freq=inv_freq,
                                         head_normalized=head_normalized, query_stride=query_stride,
                                         k_scale=k_scale, offload=offload, mask_layout=mask_layout)
    if mask_layout != "shared":
        if reduce_scores is not None:
            raise ValueError("reduce_scores (tensor parallelism's max over ranks) is for the shared layout: a "
                             "per-head selection needs only its own head's scores; pass reduce_scores=None")
        NB, H, C = scores.shape
        candidates, cand_lens = per_head_rows(candidates, cand_lens, H)
        sel, lens = topk_chunks_ref(scores.reshape(NB * H, C), candidates.reshape(NB * H, -1),
                                    cand_lens.reshape(NB * H), chunk_size=chunk_size, k=k, n_sink=n_sink)
        return sel.view(NB, H, k), lens.view(NB, H)
    if reduce_scores is not None:  # tensor parallelism: the max over every rank's kv heads
        reduce_scores(scores)
    return topk_chunks_ref(scores, candidates, cand_lens, chunk_size=chunk_size, k=k, n_sink=n_sink)
