"""Plain-torch float64 reference of the InfiniteHiP pruning stage (pruning.py has the math).

Written for reading, not speed: per query block it scores *every* candidate against the block's
queries (sigma tables, one per SelectRep branch since RELATIVE RoPE puts the two branches at
different positions), then replays the tournament on those tables and picks the top chunks by
sorting in Python. It also reports, per chunk, the smallest |sigma_right - sigma_left| seen in
the tournament, so tests can tell genuine disagreements from float32-vs-float64 near-ties.
"""

from __future__ import annotations

import math

import torch

from ..kv_offload import merged_kv
from ..kv_quant import check_kv_scales, read_rows
from .blocks import PAD, initial_candidates
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


def select_rep_scores_ref(q, k_cache, block_tables, q_start, q_lens, ends, candidates=None,
                          cand_lens=None, *, chunk_size: int, n_sink: int, n_stream: int,
                          max_candidates: int | None = None, rope_style="none", inv_freq=None,
                          head_normalized: bool = False, query_stride: int = 1, k_scale=None, offload=None):
    """Reference of pruning.select_rep_scores: (scores float64 [NB, C], reps int32 [NB, Hkv, C],
    margins float64 [NB, Hkv, C] = smallest |sigma_right - sigma_left| of each tournament).
    head_normalized: each kv head's chunk scores minus that head's best, then the max.
    query_stride s: only the block's queries min(s (i + 1) - 1, q_len - 1) score. k_scale: an
    fp8 k_cache's row scales (its keys dequantized to float32 rows).
    offload: host twin of the cache; table entries < 0 name its pages (kv_offload.py)."""
    k_cache, _, k_scale, _, block_tables = merged_kv(k_cache, None, k_scale, None, block_tables, offload)
    scaled = check_kv_scales(k_cache, None, k_scale, None)
    style = rope_style_id(rope_style)
    if candidates is None:
        candidates, cand_lens = initial_candidates(ends, n_sink, n_stream, width=max_candidates)
    elif cand_lens is None:
        cand_lens = (candidates != PAD).sum(-1)
    NB, Hkv, page = ends.shape[0], k_cache.shape[2], k_cache.shape[1]
    C = math.ceil(candidates.shape[1] / chunk_size)
    scores = torch.full((NB, C), -math.inf, dtype=torch.float64)
    reps = torch.full((NB, Hkv, C), PAD, dtype=torch.int32)
    margins = torch.full((NB, Hkv, C), math.inf, dtype=torch.float64)
    for i in range(NB):
        q_len, e, n = int(q_lens[i]), int(ends[i]), int(cand_lens[i])
        if n == 0 or q_len == 0:
            continue
        toks = candidates[i, :n].long().cpu()
        pages, slots = block_tables[i, toks // page].long(), (toks % page).to(block_tables.device)
        keys = read_rows(k_cache, k_scale, pages, slots, torch.float32 if scaled else k_cache.dtype).cpu()  # [n, Hkv, D]
        sampled = torch.arange(query_stride - 1, q_len - 1 + query_stride, query_stride).clamp(max=q_len - 1)
        q_rows = q[int(q_start[i]):int(q_start[i]) + q_len].cpu()[sampled]
        q_pos = torch.arange(e - q_len, e)[sampled]
        nc = math.ceil(n / chunk_size)
        left, right = _sigma_tables(q_rows, q_pos, keys, toks, torch.arange(n) // chunk_size, nc,
                                    n_stream, style, inv_freq.cpu() if inv_freq is not None else None)
        pad = nc * chunk_size - n  # the short last chunk: its missing tail never wins
        left = torch.nn.functional.pad(left, (0, pad), value=-math.inf)
        right = torch.nn.functional.pad(right, (0, pad), value=-math.inf)
        base = torch.arange(nc) * chunk_size  # [nc]
        first = torch.zeros(Hkv, nc, dtype=torch.long)
        win = left[:, base]  # sigma of the current range's first candidate
        half = chunk_size
        while half > 1:
            half //= 2
            s_left = left.gather(1, base + first) if style == RELATIVE else win
            s_right = right.gather(1, base + first + half)
            has_right = first + half < n - base  # right half starts inside the chunk
            s_right = torch.where(has_right, s_right, -math.inf)
            gap = torch.where(has_right, (s_right - s_left).abs(), math.inf)
            margins[i, :, :nc] = torch.minimum(margins[i, :, :nc], gap)
            first = torch.where(s_right > s_left, first + half, first)
            win = torch.maximum(s_left, s_right)
        if head_normalized:
            best = win.amax(dim=1, keepdim=True)
            win = torch.where(best > -math.inf, win - best, win)
        scores[i, :nc] = win.amax(dim=0)
        reps[i, :, :nc] = toks[base + first].to(torch.int32)
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
                      reduce_scores=None):
    """Reference of pruning.pruning_stage: (survivors int32 [NB, k] PAD-padded, lens [NB]).
    k_scale: an fp8 k_cache's row scales.
    offload: host twin of the cache; table entries < 0 name its pages (kv_offload.py)."""
    if candidates is None:
        candidates, cand_lens = initial_candidates(ends, n_sink, n_stream, width=max_candidates)
    elif cand_lens is None:
        cand_lens = (candidates != PAD).sum(-1)
    scores, _, _ = select_rep_scores_ref(q, k_cache, block_tables, q_start, q_lens, ends, candidates,
                                         cand_lens, chunk_size=chunk_size, n_sink=n_sink,
                                         n_stream=n_stream, rope_style=rope_style, inv_freq=inv_freq,
                                         head_normalized=head_normalized, query_stride=query_stride,
                                         k_scale=k_scale, offload=offload)
    if reduce_scores is not None:  # tensor parallelism: the max over every rank's kv heads
        reduce_scores(scores)
    return topk_chunks_ref(scores, candidates, cand_lens, chunk_size=chunk_size, k=k, n_sink=n_sink)
