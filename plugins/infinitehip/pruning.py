"""InfiniteHiP pruning stage (paper 000, Algorithms 2-3): one kernel for every stage (b_q, l_c, k).

For a query block (blocks.py) with queries q_t (all q heads h of kv head g(h)) and sorted
candidate tokens I (stage 1: the whole middle [n_sink, s), walked implicitly), split I into
chunks C_j = I[j l_c : (j+1) l_c] (the last one may be short) and, per chunk and kv head g,
pick a representative with SelectRep, a top-1 tournament of ceil(log2 l_c) halvings:

    sigma(i)    = max over the block's queries t and the q heads h of g, causal (I[i] <= pos_t),
                  of q_{t,h} . k_{I[i], g}                   (unscaled; keys per RoPE style)
    range [f, f + 2w) -> compare sigma(f) (left half's first) with sigma(f + w) (right half's
                  first); the right half wins only if strictly greater (ties keep the left);
                  a right half starting past the chunk's end never wins
    r_{j,g}     = f after the last halving,   s_j = max over g of the last winner's sigma

then keep the top K = k / l_c chunks by s_j (a second kernel, _topk_expand_kernel: the one
global step)
and return their candidates, ascending: int32 [NB, k], PAD-padded, plus their count (k unless
the short last chunk or fewer than K chunks were kept). l_c must be a power of two.

Mask layouts (blocks.MASK_LAYOUTS; the runtime calls "shared" today): "kv_head" keeps one
selection per kv head, r_{j,g} scored by sigma of head g alone (the kernel's per-head scores
without the max over g; top-k per (block, g)); "q_head" keeps one per query head h (the authors'
hip-attention v1_2): the grid's head axis runs over Hq, a program's query tile holds h's rows only
and loads keys of kv head h // group. Survivors then carry a head axis, [NB, H, k].

Query stride s (InfiniteHipConfig.query_strides): the max over t runs over the block's queries
t = min(s (i + 1) - 1, q_len - 1), i = 0 .. ceil(b_q / s) - 1 only (the last of every s; s = 1 is
the paper's formula) — 1/s of the dot work, the same mask for the whole block.

Kernel: grid (NB, cdiv(max_chunks, BLOCK_C * TILES), Hkv); a program loads and rotates the
[ceil(b_q / s) * group, D] query tile of one query block and kv head once, then takes TILES
tiles of BLOCK_C chunks through the tournament, each tile's chunks in lock-step: each halving
loads one key per chunk (the right representative; the left one's sigma is the previous
winner's), scores it against the query tile with one tl.dot and a max; per-head scores go to
global memory and a max over heads (a torch reduction) follows. No program waits on another.
RoPE styles (rope_styles.py) rotate the query tile once and each loaded key. RELATIVE puts
every key at position 0 (un-rotated) and the branch offset on the query: a second query tile one
position closer scores right representatives, and the winner's sigma at the left position comes
from the key just loaded (one load and one rotation per halving, two dots; the last halving
needs no left score: one). CHUNK_INDEXED numbers
chunks within the block's own candidate list. With RawKeys (raw_keys.py: keys un-rotated once per
prefill step) no key is rotated per load; CHUNK_INDEXED then rotates by a sin/cos computed once
per tile.

FP8 cache (plugins/kv_quant.py; a PagedKV with row scales): each loaded key row is rotated in float32 as above
and multiplied by its row scale afterwards (rotations are linear), then cast to the queries'
dtype for the dot: one extra [BLOCK_C] float32 load per key load. RawKeys are already in the
queries' dtype (raw_keys.py dequantizes when it un-rotates): no scales then.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_utils import dot_precision, next_pow2, triton_on
from ..aot import recording_target
from ..kv_offload import page_offset
from ..kv_quant import dequantize_tile
from ..paged_kv import PagedKV
from .blocks import PAD, mask_heads, per_head_rows, stream_starts
from .raw_keys import RawKeys
from .rope_styles import (C_CHUNK_INDEXED, C_NONE, C_RELATIVE, CHUNK_INDEXED, NONE, RELATIVE,
                          check_rotatable, load_rotated, load_rotated_by, rope_style_id, sin_cos_of)

_BLOCK_C = 32  # chunks per program (tl.dot needs >= 16 columns)


@triton.jit
def _candidate_tokens(cand_row, idx, valid, n_sink, CAND_IMPLICIT: tl.constexpr):
    """Token of candidate idx of the block: n_sink + idx (stage 1) or the stored index."""
    if CAND_IMPLICIT:
        tok = n_sink + idx
    else:
        tok = tl.load(cand_row + idx, mask=valid, other=0)
    return tok


@triton.jit
def _load_keys(tok, tok_valid, key_pos, k_head_ptr, s_head_ptr, table_row, raw_base, sin, cos, stride_cp,
               stride_cs, stride_sp, stride_ss, stride_rt, k_host_delta, ks_host_delta, inv_freq_ptr, head_dim,
               PAGE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, RAW_KEYS: tl.constexpr, KEY_ROTATION: tl.constexpr,
               KV_SCALED: tl.constexpr, OFFLOAD: tl.constexpr):
    """Keys [BLOCK_C, BLOCK_D] float32 of BLOCK_C tokens, from the paged cache or (RAW_KEYS) from
    RawKeys rows raw_base + tok; KEY_ROTATION 0: as stored, 1: by key_pos - tok (the style's
    position of each key), 2: by the given sin/cos [BLOCK_C, BLOCK_D // 2]. KV_SCALED (an fp8
    cache, never with RAW_KEYS): each row times its scale (s_head_ptr: the kv head's scales),
    after the rotation. OFFLOAD: table entries < 0 are host pages, k_host_delta / ks_host_delta
    elements from the cache / its scales (kv_offload.page_offset)."""
    if RAW_KEYS:
        rows = k_head_ptr + (raw_base + tok).to(tl.int64) * stride_rt
    else:
        page = tl.load(table_row + tok // PAGE_SIZE, mask=tok_valid, other=0)
        rows = k_head_ptr + page_offset(page, stride_cp, k_host_delta, OFFLOAD) + (tok % PAGE_SIZE) * stride_cs
    if KEY_ROTATION == 2:
        k = load_rotated_by(rows, tok_valid, sin, cos, head_dim, BLOCK_D)
    else:
        k = load_rotated(rows, tok_valid, key_pos - tok, inv_freq_ptr, head_dim, BLOCK_D, KEY_ROTATION == 1)
    if KV_SCALED:  # the row's scale index from the scale tensor's strides (head_dim 1: no division)
        k = dequantize_tile(k, s_head_ptr, page_offset(page, stride_sp, ks_host_delta, OFFLOAD)
                            + (tok % PAGE_SIZE) * stride_ss, tok_valid, 1, KV_SCALED)
    return k


@triton.jit
def _max_score(q, k, q_pos, row_valid, tok, tok_valid, DOT_PRECISION: tl.constexpr,
               KEYS_AS_ROWS: tl.constexpr):
    """sigma of BLOCK_C keys k [BLOCK_C, BLOCK_D] (q's dtype): causal max over the q rows
    [BLOCK_Q, BLOCK_D] of q . k -> [BLOCK_C] (-inf where invalid). KEYS_AS_ROWS computes the
    transposed product k . q^T [BLOCK_C, BLOCK_Q] and reduces along its rows instead of its
    columns: the same values, a launch choice (faster for stage 1 with 64-row query tiles on the
    H200, slower elsewhere; select_rep_scores)."""
    if KEYS_AS_ROWS:
        s = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # [BLOCK_C, BLOCK_Q]
        visible = tok_valid[:, None] & row_valid[None, :] & (tok[:, None] <= q_pos[None, :])
        return tl.max(tl.where(visible, s, float("-inf")), axis=1)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_Q, BLOCK_C]
    visible = row_valid[:, None] & tok_valid[None, :] & (tok[None, :] <= q_pos[:, None])
    return tl.max(tl.where(visible, s, float("-inf")), axis=0)


@triton.jit
def _score_right(q_right, q_pos, row_valid, first, half, chunk_len, base, key_pos, cand_row, table_row, k_head,
                 s_head, raw_base, sin, cos, inv_freq_ptr, stride_cp, stride_cs, stride_sp, stride_ss, stride_rt,
                 k_host_delta, ks_host_delta, head_dim, n_sink, PAGE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
                 CAND_IMPLICIT: tl.constexpr, RAW_KEYS: tl.constexpr, KEY_ROTATION: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, KEYS_AS_ROWS: tl.constexpr, KV_SCALED: tl.constexpr,
                 OFFLOAD: tl.constexpr):
    """One halving's right representative (offset first + half of each chunk): (its offset,
    token, validity, key [BLOCK_C, BLOCK_D], sigma as a right representative)."""
    right = first + half
    r_valid = right < chunk_len
    r_tok = _candidate_tokens(cand_row, base + right, r_valid, n_sink, CAND_IMPLICIT)
    k = _load_keys(r_tok, r_valid, key_pos, k_head, s_head, table_row, raw_base, sin, cos, stride_cp, stride_cs,
                   stride_sp, stride_ss, stride_rt, k_host_delta, ks_host_delta, inv_freq_ptr, head_dim, PAGE_SIZE,
                   BLOCK_D, RAW_KEYS, KEY_ROTATION, KV_SCALED, OFFLOAD).to(q_right.dtype)
    s_right = _max_score(q_right, k, q_pos, row_valid, r_tok, r_valid, DOT_PRECISION, KEYS_AS_ROWS)
    return right, r_tok, r_valid, k, s_right


@triton.jit
def _tournament_tile(q_left, q_right, q_pos, row_valid, first_chunk, n_cand, cand_row, table_row,
                     k_head, s_head, raw_base, inv_freq_ptr, stride_cp, stride_cs, stride_sp, stride_ss,
                     stride_rt, k_host_delta, ks_host_delta, head_dim, n_sink, chunk_size, num_iters,
                     PAGE_SIZE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
                     CAND_IMPLICIT: tl.constexpr, ROPE_STYLE: tl.constexpr, RAW_KEYS: tl.constexpr,
                     KEY_ROTATION: tl.constexpr, DOT_PRECISION: tl.constexpr, KEYS_AS_ROWS: tl.constexpr,
                     KV_SCALED: tl.constexpr, OFFLOAD: tl.constexpr):
    """SelectRep on BLOCK_C chunks of one kv head in lock-step -> (sigma of each winner [BLOCK_C],
    -inf for empty chunks; the winner's offset within its chunk [BLOCK_C]). q_left / q_right:
    the query tile scoring left / right representatives (the same tile except under RELATIVE,
    where keys sit at position 0 and each branch's position is moved onto the query). Under
    RELATIVE the last halving runs after the loop, without the winner's left re-score that only
    a next halving would read: 2 log2(l_c) dots per chunk instead of 2 log2(l_c) + 1, and no
    branch inside the loop (H200, 1M keys: stage 3 14.4 -> 13.2 ms)."""
    chunk = first_chunk + tl.arange(0, BLOCK_C)
    base = chunk * chunk_size
    chunk_len = tl.minimum(tl.maximum(n_cand - base, 0), chunk_size)  # valid candidates per chunk
    has = chunk_len > 0
    # the position each key is rotated to (KEY_ROTATION 1): RELATIVE 0 (un-rotated; the branch
    # offsets are on q_left / q_right), CHUNK_INDEXED the chunk's index, NONE ignored
    key_pos = chunk * 0 if ROPE_STYLE == C_RELATIVE else chunk
    sin = None
    cos = None
    if KEY_ROTATION == 2:  # raw CHUNK_INDEXED: every key of a chunk at the chunk's index, once per tile
        sin, cos = sin_cos_of(chunk, inv_freq_ptr, head_dim, BLOCK_D)
    first = chunk * 0  # offset of the current range's first candidate within the chunk
    tok = _candidate_tokens(cand_row, base, has, n_sink, CAND_IMPLICIT)
    k = _load_keys(tok, has, key_pos, k_head, s_head, table_row, raw_base, sin, cos, stride_cp, stride_cs,
                   stride_sp, stride_ss, stride_rt, k_host_delta, ks_host_delta, inv_freq_ptr, head_dim, PAGE_SIZE,
                   BLOCK_D, RAW_KEYS, KEY_ROTATION, KV_SCALED, OFFLOAD).to(q_left.dtype)
    s_left = _max_score(q_left, k, q_pos, row_valid, tok, has, DOT_PRECISION, KEYS_AS_ROWS)
    best = s_left
    half = chunk_size
    PEELED: tl.constexpr = ROPE_STYLE == C_RELATIVE
    for _ in range(num_iters - 1 if PEELED else num_iters):
        half = half // 2
        right, r_tok, r_valid, k, s_right = _score_right(
            q_right, q_pos, row_valid, first, half, chunk_len, base, key_pos, cand_row, table_row, k_head, s_head,
            raw_base, sin, cos, inv_freq_ptr, stride_cp, stride_cs, stride_sp, stride_ss, stride_rt, k_host_delta,
            ks_host_delta, head_dim, n_sink, PAGE_SIZE, BLOCK_D, CAND_IMPLICIT, RAW_KEYS, KEY_ROTATION,
            DOT_PRECISION, KEYS_AS_ROWS, KV_SCALED, OFFLOAD)
        wins = s_right > s_left
        first = tl.where(wins, right, first)
        best = tl.maximum(s_left, s_right)  # sigma of the winner
        if ROPE_STYLE == C_RELATIVE:
            # the winner is the next range's first, i.e. the left branch: its sigma at the left
            # position, from the key already loaded (no reload, no second rotation)
            s_left = tl.where(wins, _max_score(q_left, k, q_pos, row_valid, r_tok, r_valid, DOT_PRECISION, KEYS_AS_ROWS),
                              s_left)
        else:
            s_left = best
    if PEELED:
        if num_iters > 0:
            half = half // 2
            right, r_tok, r_valid, k, s_right = _score_right(
                q_right, q_pos, row_valid, first, half, chunk_len, base, key_pos, cand_row, table_row, k_head,
                s_head, raw_base, sin, cos, inv_freq_ptr, stride_cp, stride_cs, stride_sp, stride_ss, stride_rt,
                k_host_delta, ks_host_delta, head_dim, n_sink, PAGE_SIZE, BLOCK_D, CAND_IMPLICIT, RAW_KEYS,
                KEY_ROTATION, DOT_PRECISION, KEYS_AS_ROWS, KV_SCALED, OFFLOAD)
            first = tl.where(s_right > s_left, right, first)
            best = tl.maximum(s_left, s_right)
    return best, first


# Ints that vary with the request are not specialized (one binary for every value, plugins/aot.py):
# the block-table row stride (the step's longest page list), the stage-1 chunk count (the
# candidate capacity, which doubles with the context) and the host deltas (int64 always: a host
# twin is far from the GPU pool, a staging twin may be near it). Their only uses are address
# arithmetic of gathered rows and the per-tile score stores; model dims and plan-fixed ints stay
# specialized.
@triton.jit(do_not_specialize=["stride_bt", "max_chunks", "k_host_delta", "ks_host_delta"])
def _select_rep_kernel(
    # inputs
    q_ptr,  # [T, Hq, D] packed queries, rotated at their positions
    k_cache_ptr,  # [num_pages, page_size, Hkv, D]
    k_scale_ptr,  # KV_SCALED: [num_pages, page_size, Hkv] float32 row scales of the fp8 cache
    raw_ptr,  # RAW_KEYS: RawKeys.keys [N, Hkv, D] (keys at position 0, token order)
    raw_base_ptr,  # RAW_KEYS: [NB] int64 row of each block's token 0 in raw_ptr
    block_tables_ptr,  # [NB, max_pages] int32
    q_start_ptr, q_lens_ptr, ends_ptr,  # [NB] int32 query blocks
    cand_ptr,  # [NB, (H,) max_cand] int32 ascending candidates (unused if CAND_IMPLICIT)
    cand_lens_ptr,  # [NB, (H)] int32 (unused if CAND_IMPLICIT)
    inv_freq_ptr,  # [D/2] float32 (unused if ROPE_STYLE == NONE)
    # outputs
    scores_ptr,  # [NB, H, max_chunks] float32 per-head chunk scores, -inf past the block's
    #              chunks (every entry written: no fill needed)
    reps_ptr,  # [NB, H, max_chunks] int32 representatives, PAD past the chunks (STORE_REPS)
    # constants
    stride_qt, stride_qh,
    stride_cp, stride_cs, stride_ch,
    stride_sp, stride_ss, stride_sh,  # KV_SCALED: the scale tensor's strides
    k_host_delta: tl.int64, ks_host_delta: tl.int64,  # OFFLOAD: elements from k_cache / k_scale to their host twins
    stride_rt, stride_rh,
    stride_bt, stride_cand, stride_cand_h,  # stride_cand_h 0: one candidate row for all heads
    stride_lens_b, stride_lens_h,  # cand_lens' strides (shared: 1, 0)
    max_chunks,
    num_heads,  # H: scored heads per block (shared / kv_head: Hkv; q_head: Hq)
    group_size,  # q heads per scored head (Hq / H)
    heads_per_kv,  # scored heads per kv head (H / Hkv)
    head_dim,
    n_sink, n_stream, chunk_size, num_iters, query_stride,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # ceil(b_q / stride) * group_size query rows, a power of two >= 16
    BLOCK_C: tl.constexpr,  # chunks per tile
    TILES: tl.constexpr,  # tiles per program (its query tile is loaded and rotated once)
    BLOCK_D: tl.constexpr,
    CAND_IMPLICIT: tl.constexpr,  # stage 1: candidates are the block's middle [n_sink, s)
    STORE_REPS: tl.constexpr,
    ROPE_STYLE: tl.constexpr,  # NONE | RELATIVE | CHUNK_INDEXED
    RAW_KEYS: tl.constexpr,  # keys from raw_ptr (raw_keys.py), not the paged cache
    KEY_ROTATION: tl.constexpr,  # 0 none (NONE; raw RELATIVE), 1 by style position - token (RELATIVE:
    #                              un-rotate), 2 by chunk index (raw CHUNK_INDEXED)
    DOT_F32: tl.constexpr,  # float32 dot operands (CPU interpreter, float32 queries)
    DOT_PRECISION: tl.constexpr,
    KEYS_AS_ROWS: tl.constexpr,  # score tiles as [chunks, queries] (_max_score)
    KV_SCALED: tl.constexpr,  # keys from an fp8 cache (kv_quant.py): rows times their scales
    OFFLOAD: tl.constexpr,  # table entries < 0 name host pages (kv_offload.py)
):
    blk = tl.program_id(0)
    head = tl.program_id(2)  # the scored head: its q heads head * group_size + [0, group_size)
    kv_head = head // heads_per_kv
    q_len = tl.load(q_lens_ptr + blk)
    q0 = tl.load(q_start_ptr + blk)
    end = tl.load(ends_ptr + blk)
    cand_row = cand_ptr + blk.to(tl.int64) * stride_cand + head * stride_cand_h
    table_row = block_tables_ptr + blk.to(tl.int64) * stride_bt
    if CAND_IMPLICIT:
        n_cand = tl.maximum(tl.maximum(tl.minimum(n_sink, end), end - n_stream) - n_sink, 0)
    else:
        n_cand = tl.load(cand_lens_ptr + blk * stride_lens_b + head * stride_lens_h)

    rows = tl.arange(0, BLOCK_Q)
    sample = rows // group_size  # the i-th sampled query of the block
    row_valid = sample * query_stride < q_len
    t = tl.minimum((sample + 1) * query_stride - 1, q_len - 1)
    q_pos = end - q_len + t  # [BLOCK_Q] original query positions
    q_rows = q_ptr + (q0 + t).to(tl.int64) * stride_qt + (head * group_size + rows % group_size) * stride_qh
    if ROPE_STYLE == C_RELATIVE:
        q_delta = n_stream + 1 - q_pos
    elif ROPE_STYLE == C_CHUNK_INDEXED:
        q_delta = tl.minimum(q_pos, tl.cdiv(n_cand, chunk_size) + n_stream) - q_pos
    else:
        q_delta = q_pos * 0
    q_left = load_rotated(q_rows, row_valid, q_delta, inv_freq_ptr, head_dim, BLOCK_D, ROPE_STYLE != C_NONE)
    if not DOT_F32:
        q_left = q_left.to(q_ptr.dtype.element_ty)  # dots in the queries' dtype
    q_right = q_left
    if ROPE_STYLE == C_RELATIVE:  # q . R(1) k = R(-1) q . k: the right branch's query one closer
        q_right = load_rotated(q_rows, row_valid, q_delta - 1, inv_freq_ptr, head_dim, BLOCK_D, True)
        if not DOT_F32:
            q_right = q_right.to(q_ptr.dtype.element_ty)
    if RAW_KEYS:
        k_head = raw_ptr + kv_head * stride_rh
        raw_base = tl.load(raw_base_ptr + blk)
    else:
        k_head = k_cache_ptr + kv_head * stride_ch
        raw_base = blk.to(tl.int64) * 0
    s_head = k_scale_ptr + kv_head * stride_sh  # KV_SCALED
    out_row = (blk.to(tl.int64) * num_heads + head) * max_chunks
    for tile in range(TILES):
        first_chunk = (tl.program_id(1) * TILES + tile) * BLOCK_C
        best, first = _tournament_tile(q_left, q_right, q_pos, row_valid, first_chunk, n_cand, cand_row,
                                       table_row, k_head, s_head, raw_base, inv_freq_ptr, stride_cp, stride_cs,
                                       stride_sp, stride_ss, stride_rt, k_host_delta, ks_host_delta, head_dim,
                                       n_sink, chunk_size, num_iters, PAGE_SIZE, BLOCK_C, BLOCK_D, CAND_IMPLICIT,
                                       ROPE_STYLE, RAW_KEYS, KEY_ROTATION, DOT_PRECISION, KEYS_AS_ROWS, KV_SCALED,
                                       OFFLOAD)
        chunk = first_chunk + tl.arange(0, BLOCK_C)
        in_row = chunk < max_chunks
        tl.store(scores_ptr + out_row + chunk, best, mask=in_row)
        if STORE_REPS:
            has = n_cand > chunk * chunk_size
            rep = _candidate_tokens(cand_row, chunk * chunk_size + first, has, n_sink, CAND_IMPLICIT)
            tl.store(reps_ptr + out_row + chunk, tl.where(has, rep, 2147483647), mask=in_row)


def _num_iters(chunk_size: int) -> int:
    assert chunk_size >= 1 and chunk_size & (chunk_size - 1) == 0, "l_c must be a power of two"
    return chunk_size.bit_length() - 1


def _candidate_lens(ends, candidates, cand_lens, n_sink, n_stream):
    if candidates is None:
        return (stream_starts(ends, n_sink, n_stream) - n_sink).clamp(min=0)
    return cand_lens if cand_lens is not None else (candidates != PAD).sum(-1).to(torch.int32)


def select_rep_scores(q, kv: PagedKV, block_tables, q_start, q_lens, ends, candidates=None,
                      cand_lens=None, *, chunk_size: int, block_q: int, n_sink: int, n_stream: int,
                      max_candidates: int | None = None, rope_style="none",
                      inv_freq: torch.Tensor | None = None, store_reps: bool = False,
                      head_normalized: bool = False, query_stride: int = 1,
                      raw_keys: RawKeys | None = None, block_c: int | None = None,
                      tiles: int | None = None, num_warps: int | None = None, keys_as_rows: bool | None = None,
                      mask_layout: str = "shared"):
    """Triton SelectRep: chunk scores float32 [NB, max_chunks] and (store_reps) representatives
    int32 [NB, Hkv, max_chunks]. mask_layout (blocks.MASK_LAYOUTS) "kv_head" / "q_head": one
    tournament and score row per mask head (H = Hkv / Hq; a q head's tournament scores with that
    head alone), scores and reps [NB, H, max_chunks], candidates [NB, n] (every head) or
    [NB, H, n] with lens [NB, H]; head_normalized is not applied (it changes no ranking within a
    head). "kv_head" is the shared launch without the max over heads; "q_head" launches H = Hq
    programs per block and tile, each loading its kv head's keys. candidates None = stage 1 (the
    middle, implicitly); then max_candidates must be >= every block's middle length (a fixed
    capacity keeps the grid graph-capturable; a smaller one silently drops the newest candidates;
    default: read from ends, a host sync). head_normalized: per kv head, subtract the head's best chunk score before
    the max over heads (InfiniteHipConfig.chunk_score). query_stride: score with every s-th query
    of a block (InfiniteHipConfig.query_strides). raw_keys: the blocks' keys at position 0
    (raw_keys.unrotate_keys), read instead of re-rotating cached keys when a dynamic RoPE style
    is on (ignored for "none"). block_c / tiles / num_warps / keys_as_rows: tuning overrides
    (keys_as_rows: score tiles transposed, the same values). kv: the layer's cache (keys only
    read; plugins/paged_kv.py): an fp8 one's row scales dequantize the keys (raw_keys are then
    in q's dtype: raw_keys.unrotate_keys(..., dtype=q.dtype)); table entries < 0 name pages of
    its host twin (kv_offload.py)."""
    k_cache = kv.k
    T, Hq, D = q.shape
    num_pages, page_size, Hkv, Dk = k_cache.shape
    NB = ends.shape[0]
    scaled = kv.check(values=False)
    assert Dk == D and Hq % Hkv == 0 and (scaled or q.dtype == k_cache.dtype)
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and page_size & (page_size - 1) == 0
    for meta in (q_start, q_lens, ends):
        assert meta.shape == (NB,) and meta.dtype == torch.int32 and meta.is_contiguous()
    assert block_tables.dtype == torch.int32 and block_tables.shape[0] == NB and block_tables.stride(1) == 1
    assert query_stride >= 1, f"query_stride must be >= 1, got {query_stride}"
    H = mask_heads(mask_layout, Hq, Hkv)
    per_head = mask_layout != "shared"
    Hs = H if per_head else Hkv  # scored heads: the kernel's programs per block and tile
    style = rope_style_id(rope_style)
    assert style in (NONE, RELATIVE, CHUNK_INDEXED), "pruning takes none | relative | chunk_indexed"
    if style != NONE:
        assert inv_freq is not None and inv_freq.shape == (D // 2,) and inv_freq.dtype == torch.float32
        check_rotatable(D)
    implicit = candidates is None
    if implicit:
        if max_candidates is None:
            max_candidates = int(_candidate_lens(ends, None, None, n_sink, n_stream).max().item()) if NB else 0
        cand, cand_lens = ends, ends  # dummies, never read
        cand_strides = (1, 0, 1, 0)  # (row, head, lens row, lens head)
    else:
        assert candidates.dtype == torch.int32 and candidates.shape[0] == NB and candidates.stride(-1) == 1
        max_candidates = candidates.shape[-1]
        cand_lens = _candidate_lens(ends, candidates, cand_lens, n_sink, n_stream)
        cand = candidates
        if candidates.dim() == 3:  # one row per mask head
            assert per_head and candidates.shape[1] == H and cand_lens.shape == (NB, H), \
                f"per-head candidates [NB, {H}, n] (lens [NB, {H}]) need mask_layout {mask_layout!r}'s H = {H}"
            cand_strides = (candidates.stride(0), candidates.stride(1), cand_lens.stride(0), cand_lens.stride(1))
        else:
            assert candidates.dim() == 2 and cand_lens.shape == (NB,), "candidates [NB, n] with lens [NB]"
            cand_strides = (candidates.stride(0), 0, cand_lens.stride(0), 0)
    max_chunks = triton.cdiv(max_candidates, chunk_size)
    Gs = Hq // Hs  # q heads per scored head
    BLOCK_Q, BLOCK_C, TILES, keys_as_rows, n_tiles = _tiling(NB, Hs, Gs, block_q, query_stride, max_chunks, implicit,
                                                             style, block_c, tiles, keys_as_rows)
    raw = raw_keys if style != NONE else None
    if raw is not None:
        assert raw.keys.dtype == q.dtype and raw.keys.shape[1:] == (Hkv, D) and raw.keys.stride(2) == 1
        assert raw.block_base.shape == (NB,) and raw.block_base.dtype == torch.int64
    if NB == 0 or max_chunks == 0:
        scores = torch.full((NB, H, max_chunks) if per_head else (NB, max_chunks), float("-inf"),
                            dtype=torch.float32, device=q.device)
        reps = torch.full((NB, Hs, max_chunks), PAD, dtype=torch.int32, device=q.device)
        return scores, (reps if store_reps else None)
    part = torch.empty((NB, Hs, max_chunks), dtype=torch.float32, device=q.device)
    reps = torch.empty((NB, Hs, max_chunks), dtype=torch.int32, device=q.device) if store_reps else part
    dk, _, dks, _ = kv.host_deltas(values=False)
    gpu = q.is_cuda or recording_target() is not None  # recording for a GPU target: its choices
    _select_rep_kernel[(NB, triton.cdiv(n_tiles, TILES), Hs)](
        q, k_cache, kv.scale_ptrs()[0],
        raw.keys if raw is not None else k_cache, raw.block_base if raw is not None else ends,
        block_tables, q_start, q_lens, ends, cand, cand_lens,
        inv_freq if inv_freq is not None else part,
        part, reps,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *kv.scale_strides(), dk, dks,
        raw.keys.stride(0) if raw is not None else 0, raw.keys.stride(1) if raw is not None else 0,
        block_tables.stride(0), *cand_strides,
        max_chunks, Hs, Gs, Hs // Hkv, D, n_sink, n_stream, chunk_size, _num_iters(chunk_size), query_stride,
        PAGE_SIZE=page_size, BLOCK_Q=BLOCK_Q, BLOCK_C=BLOCK_C, TILES=TILES,
        BLOCK_D=max(16, next_pow2(D)), CAND_IMPLICIT=implicit, STORE_REPS=store_reps,
        ROPE_STYLE=style, RAW_KEYS=raw is not None,
        KEY_ROTATION=0 if style == NONE or (raw is not None and style == RELATIVE) else 2 if raw is not None else 1,
        DOT_F32=not gpu or q.dtype == torch.float32,
        DOT_PRECISION=dot_precision(q.dtype if gpu else torch.float32), KEYS_AS_ROWS=keys_as_rows,
        # raw keys come dequantized, and are read without page tables
        **kv.kernel_flags(reads_pages=raw is None),
        # H200, 1M keys: 256-row query tiles (stride 1) 8 warps (stage 1 112 vs 163 ms, stage 3
        # 14 vs 27 ms); 64-row tiles (stride 4) and decode 4 (stage 1 24 vs 35 ms)
        num_warps=num_warps or (8 if BLOCK_Q >= 256 else 4),
    )
    if per_head:
        return part, (reps if store_reps else None)
    if head_normalized:  # [NB, Hkv, C] - each head's best chunk (rows with no chunk stay -inf)
        best = part.amax(dim=2, keepdim=True)
        part = torch.where(best > float("-inf"), part - best, part)
    return part.amax(dim=1), (reps if store_reps else None)


def _tiling(NB: int, Hkv: int, G: int, block_q: int, query_stride: int, max_chunks: int, implicit: bool,
            style: int, block_c: int | None = None, tiles: int | None = None, keys_as_rows: bool | None = None):
    """select_rep_scores' launch shape: (BLOCK_Q, BLOCK_C, TILES, keys_as_rows, n_tiles) for NB
    query blocks of Hkv heads with max_chunks chunks (overrides: tuning)."""
    BLOCK_Q = max(16, next_pow2(triton.cdiv(block_q, query_stride) * G))
    # Measured on the H200 (docs/benchmarks.md): 32 chunks per tile (decode stage 1 at 1M keys:
    # 211 vs 285 µs with 16; decode stages 2 / 3 under dynamic RoPE: 32 vs 54 µs and 23 vs
    # 39 µs, 2026-11-30f); with dynamic RoPE decode's stage 1 does best with 64 (94 vs 113 µs).
    BLOCK_C = block_c or (64 if implicit and BLOCK_Q < 128 and style != NONE else _BLOCK_C)
    # Score tiles as [chunks, queries] for stage 1 with mid-sized query tiles: H200, 1M keys, a
    # 32K prefill chunk at stride 4 (64-row tiles): 14.8 vs 25.4 ms (raw keys), 31.4 vs 51.3 ms
    # (re-rotated); slower for 256-row tiles (stride 1: 137 vs 113 ms) and for the gathered
    # candidates of later stages (stage 2: 7.9 vs 5.7 ms, stage 3: 16.6 vs 14.2 ms), 2026-11-30f.
    # 32- and 128-row tiles are not measured; decode (16 rows) keeps the default.
    if keys_as_rows is None:
        keys_as_rows = implicit and 32 <= BLOCK_Q <= 128
    n_tiles = triton.cdiv(max_chunks, BLOCK_C)
    # Several tiles per program only when the grid is huge (prefill): the query tile is then
    # loaded and rotated once per TILES tiles; decode grids stay one tile per program.
    TILES = tiles or min(16, next_pow2(max(1, NB * Hkv * n_tiles // 16384)))
    return BLOCK_Q, BLOCK_C, TILES, keys_as_rows, n_tiles


_MAX_FUSED_CHUNKS = 16384  # rows up to this many chunks take the fused top-k kernel


@triton.jit
def _topk_expand_kernel(
    # inputs
    scores_ptr,  # [NB, C] float32 chunk scores (row stride given)
    cand_ptr,  # [NB, max_cand] int32 candidates (unused if CAND_IMPLICIT)
    cand_lens_ptr,  # [NB] int32 candidates per block (unused if LENS_FROM_ENDS)
    ends_ptr,  # [NB] int32 (LENS_FROM_ENDS: the candidate count is the middle's length)
    # outputs
    kept_ptr,  # [NB, K] int32 scratch: the kept chunk indices, ascending
    out_ptr,  # [NB, k] int32 survivors ascending, PAD-padded
    out_lens_ptr,  # [NB] int32
    # constants
    stride_sc, stride_cand, stride_kept, stride_out,
    num_chunk_cols, num_kept, k_out, chunk_size, n_sink, n_stream,
    CAND_IMPLICIT: tl.constexpr,  # candidate i is token n_sink + i (stage 1)
    LENS_FROM_ENDS: tl.constexpr,
    BLOCK_ALL: tl.constexpr,  # >= C: the whole score row stays in registers
    BLOCK: tl.constexpr,  # output slots per step
):
    """Top K of a row without sorting: the K-th largest score is found by bisection on its
    order-preserving int32 image (32 counting passes over the register-resident row); chunks
    above it are kept, equal ones by ascending index until K — so the kept chunks come out in
    index order. Then output slot j holds candidate kept[j // l_c] * l_c + j % l_c when that is
    one of the block's candidates, else PAD (PADs only trail)."""
    blk = tl.program_id(0)
    cols = tl.arange(0, BLOCK_ALL)
    x = tl.load(scores_ptr + blk.to(tl.int64) * stride_sc + cols, mask=cols < num_chunk_cols,
                other=float("-inf"))
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed-monotone: a < b  <=>  key(a) < key(b)
    key = tl.where(cols < num_chunk_cols, key, -2147483648).to(tl.int64)  # padding: below -inf
    lo = tl.full([], -2147483648, tl.int64)  # invariant: #(key >= lo) >= K
    hi = tl.full([], 2147483647, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        enough = tl.sum((key >= mid).to(tl.int32), axis=0) >= num_kept
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    above = key > lo
    tie = key == lo
    room = num_kept - tl.sum(above.to(tl.int32), axis=0)
    keep = above | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= room))
    kept_row = kept_ptr + blk.to(tl.int64) * stride_kept
    tl.store(kept_row + tl.cumsum(keep.to(tl.int32), axis=0) - 1, cols, mask=keep)
    tl.debug_barrier()  # the expansion below reads other threads' stores

    if LENS_FROM_ENDS:
        end = tl.load(ends_ptr + blk)
        n_cand = tl.maximum(tl.maximum(tl.minimum(n_sink, end), end - n_stream) - n_sink, 0)
    else:
        n_cand = tl.load(cand_lens_ptr + blk)
    cand_row = cand_ptr + blk.to(tl.int64) * stride_cand
    out_row = out_ptr + blk.to(tl.int64) * stride_out
    count = tl.zeros([BLOCK], tl.int32)
    for start in range(0, k_out, BLOCK):
        j = start + tl.arange(0, BLOCK)
        c = j // chunk_size
        in_kept = c < num_kept
        chunk = tl.load(kept_row + c, mask=in_kept, other=0)
        idx = chunk * chunk_size + j % chunk_size
        valid = in_kept & (idx < n_cand)
        if CAND_IMPLICIT:
            tok = n_sink + idx
        else:
            tok = tl.load(cand_row + idx, mask=valid, other=0)
        tl.store(out_row + j, tl.where(valid, tok, 2147483647), mask=j < k_out)
        count += valid.to(tl.int32)
    tl.store(out_lens_ptr + blk, tl.sum(count, axis=0))


def topk_chunks(scores, candidates, cand_lens, *, chunk_size: int, k: int, n_sink: int,
                ends: torch.Tensor | None = None, n_stream: int | None = None):
    """Keep the K = k / l_c best chunks (ties: lower index) and list their candidates
    ascending: (int32 [NB, k] PAD-padded, lens int32 [NB]). candidates None = stage 1
    (n_sink + index); then cand_lens may be None if ends and n_stream are given (the middle's
    length, computed in the kernel). One Triton launch (_topk_expand_kernel) for rows of up to
    16K chunks; longer rows and CPU tensors take torch ops (topk, sort, gathers)."""
    assert k % chunk_size == 0, "k must be a multiple of l_c"
    NB, C = scores.shape
    K = min(k // chunk_size, C)
    if cand_lens is None:
        assert candidates is None and ends is not None and n_stream is not None
    if not triton_on(scores) or C > _MAX_FUSED_CHUNKS:
        if cand_lens is None:
            cand_lens = _candidate_lens(ends, None, None, n_sink, n_stream)
        return _topk_chunks_torch(scores, candidates, cand_lens, chunk_size=chunk_size, k=k, n_sink=n_sink)
    out = torch.empty((NB, k), dtype=torch.int32, device=scores.device)
    lens = torch.empty(NB, dtype=torch.int32, device=scores.device)
    if NB == 0:
        return out, lens
    if C == 0:
        return out.fill_(PAD), lens.zero_()
    assert scores.stride(1) == 1
    # the kernel reads row blk of these at ptr + blk: a per-head caller's rows may be a stride-0
    # view (expand, then a reshape that one block turns into a view), which would read past them
    cand_lens = cand_lens.contiguous() if cand_lens is not None else None
    ends = ends.contiguous() if ends is not None else None
    kept = torch.empty((NB, max(K, 1)), dtype=torch.int32, device=scores.device)
    cand = kept if candidates is None else candidates
    block_all = next_pow2(C)
    _topk_expand_kernel[(NB,)](  # an unused pointer argument gets any int32 tensor
        scores, cand, cand_lens if cand_lens is not None else lens, ends if ends is not None else lens,
        kept, out, lens,
        scores.stride(0), cand.stride(0), kept.stride(0), out.stride(0),
        C, K, k, chunk_size, n_sink, n_stream or 0,
        CAND_IMPLICIT=candidates is None, LENS_FROM_ENDS=cand_lens is None, BLOCK_ALL=block_all,
        BLOCK=min(1024, next_pow2(k)), num_warps=8 if block_all >= 4096 else 4,
    )
    return out, lens


def _topk_chunks_torch(scores, candidates, cand_lens, *, chunk_size: int, k: int, n_sink: int):
    """topk_chunks in torch ops (CPU without the interpreter)."""
    NB, C = scores.shape
    K = min(k // chunk_size, C)
    num_chunks = (cand_lens.long() + chunk_size - 1) // chunk_size  # [NB]
    top = scores.topk(K, dim=1).indices  # [NB, K]
    top = torch.where(top < num_chunks[:, None], top, C).sort(dim=1).values  # unused chunks last
    idx = (top[:, :, None] * chunk_size + torch.arange(chunk_size, device=scores.device)).flatten(1)
    valid = (idx < cand_lens.long()[:, None]) & (idx < C * chunk_size)
    if candidates is None:
        tok = n_sink + idx
    else:
        tok = candidates.long().gather(1, idx.clamp(max=max(candidates.shape[1] - 1, 0)))
    out = torch.full((NB, k), PAD, dtype=torch.int32, device=scores.device)
    out[:, :K * chunk_size] = torch.where(valid, tok, PAD).to(torch.int32)
    return out, valid.sum(1).to(torch.int32)


def pruning_stage(q, kv: PagedKV, block_tables, q_start, q_lens, ends, candidates=None, cand_lens=None,
                  *, chunk_size: int, k: int, block_q: int, n_sink: int, n_stream: int,
                  max_candidates: int | None = None, rope_style="none", inv_freq=None,
                  head_normalized: bool = False, query_stride: int = 1,
                  raw_keys: RawKeys | None = None, reduce_scores=None, mask_layout: str = "shared", **tuning):
    """One pruning stage: the Triton SelectRep kernel, then topk_chunks (CPU tensors without
    TRITON_INTERPRET: pruning_ref.pruning_stage_ref, same contract). Returns the survivors
    (int32 [NB, k] ascending, PAD-padded) and their counts (int32 [NB]), the next stage's input.
    mask_layout "kv_head" / "q_head" (blocks.MASK_LAYOUTS): one selection per mask head (H = Hkv
    / Hq), each keeping its own k: survivors [NB, H, k] and counts [NB, H]; candidates then
    [NB, H, n] (the previous stage's) or None (stage 1).
    kv: the layer's cache, keys only read (select_rep_scores).
    reduce_scores: called on the chunk scores float32 [NB, chunks] before the top-k, in place
    (tensor parallelism: the max over every rank's kv heads, so all ranks keep the chunks one
    GPU would; runtime/distributed/group.py); shared layout only (a per-head selection needs no
    other rank's scores).

        >>> sel, n = pruning_stage(q, kv, tables, q_start, q_lens, ends,   # doctest: +SKIP
        ...                        chunk_size=256, k=32768, block_q=64, n_sink=256, n_stream=1024)
        >>> sel, n = pruning_stage(q, kv, tables, q_start, q_lens, ends, sel, n,  # doctest: +SKIP
        ...                        chunk_size=32, k=8192, block_q=64, n_sink=256, n_stream=1024,
        ...                        mask_layout="q_head")   # sel [NB, Hq, 8192] from a q_head stage 1
    """
    per_head = mask_layout != "shared"
    if per_head and reduce_scores is not None:
        raise ValueError("reduce_scores (tensor parallelism's max over ranks) is for the shared layout: a "
                         "per-head selection needs only its own head's scores; pass reduce_scores=None")
    if not triton_on(q, kv.k):  # CPU without the interpreter: the float64 torch reference
        from .pruning_ref import pruning_stage_ref
        if ends.shape[0] == 0:
            H = (mask_heads(mask_layout, q.shape[1], kv.k.shape[2]),) if per_head else ()
            return (torch.full((0, *H, k), PAD, dtype=torch.int32, device=q.device),
                    torch.zeros((0, *H), dtype=torch.int32, device=q.device))
        return pruning_stage_ref(q, kv.k, block_tables, q_start, q_lens, ends, candidates, cand_lens,
                                 chunk_size=chunk_size, k=k, n_sink=n_sink, n_stream=n_stream,
                                 max_candidates=max_candidates, rope_style=rope_style, inv_freq=inv_freq,
                                 head_normalized=head_normalized, query_stride=query_stride, k_scale=kv.k_scale,
                                 offload=kv.host, reduce_scores=reduce_scores, mask_layout=mask_layout)
    if candidates is not None and cand_lens is None:  # once, for both kernels
        cand_lens = _candidate_lens(ends, candidates, None, n_sink, n_stream)
    scores, _ = select_rep_scores(q, kv, block_tables, q_start, q_lens, ends, candidates,
                                  cand_lens, chunk_size=chunk_size, block_q=block_q, n_sink=n_sink,
                                  n_stream=n_stream, max_candidates=max_candidates,
                                  rope_style=rope_style, inv_freq=inv_freq,
                                  head_normalized=head_normalized, query_stride=query_stride,
                                  raw_keys=raw_keys, mask_layout=mask_layout, **tuning)
    if per_head:  # each head's own top-k: rows (block, head) of the flattened scores
        NB, H, C = scores.shape
        if candidates is not None:
            candidates, cand_lens = per_head_rows(candidates, cand_lens, H)
            candidates, cand_lens = candidates.reshape(NB * H, -1), cand_lens.reshape(NB * H)
        sel, lens = topk_chunks(scores.view(NB * H, C), candidates, cand_lens, chunk_size=chunk_size, k=k,
                                n_sink=n_sink, ends=ends[:, None].expand(-1, H).reshape(-1), n_stream=n_stream)
        return sel.view(NB, H, k), lens.view(NB, H)
    if reduce_scores is not None:
        reduce_scores(scores)
    return topk_chunks(scores, candidates, cand_lens, chunk_size=chunk_size, k=k, n_sink=n_sink,
                       ends=ends, n_stream=n_stream)


def aot_launches(space) -> None:
    """Every SelectRep and top-k variant the runtime can launch for the engine of ``space``
    (plugins/aot.py; shape classes from _aot.py): per layer kind (stages, pruning RoPE style),
    RoPE mode (static "none" / the layer's dynamic style), with and without a host twin,

    * decode (InfiniteHipLayer._decode): one query per block of the step's whole q, 1 to
      max_batch_size rows, stage 1 walking the mode's candidate capacities, later stages the
      previous stage's cached survivors;
    * prefill (_prefill): query blocks of block_q at each stage's query stride, 1 to
      max_num_batched_tokens / block_q (+ partial) blocks, from the paged cache and, under
      dynamic RoPE, from un-rotated raw keys.

    The row / block counts matter only through TILES (one program per TILES tiles) and the
    capacity through TILES and the top-k row width: one launch per distinct _tiling result."""
    from ._aot import sparse_space

    ss = sparse_space(space)
    if ss is None:
        return
    cfg = ss.cfg
    _, Hkv, _ = ss.dims
    G = ss.dims[0] // Hkv
    kw = dict(n_sink=cfg.n_sink, n_stream=cfg.n_stream, inv_freq=ss.inv_freq(),
              head_normalized=cfg.chunk_score == "head_normalized", mask_layout=ss.mask_layout)
    for kind in ss.kinds:
        for mode in ss.modes:
            rope = kind.pruning_rope if mode.dynamic else "none"
            for offload in ss.offload:
                kv = ss.kv(offload)
                # decode: block_q 1, every query (stride 1)
                _aot_stages(ss, kind, mode, rope, G, Hkv, kv, None, kw, block_q=1,
                            strides=(1,) * len(kind.stages), max_blocks=ss.max_decode_rows)
                # prefill, from the cache and (dynamic styles) from raw keys
                raws = (False, True) if rope != "none" else (False,)
                for raw in raws:
                    _aot_stages(ss, kind, mode, rope, G, Hkv, kv, raw, kw, block_q=cfg.block_q,
                                strides=cfg.query_strides, max_blocks=ss.max_prefill_blocks)


def _aot_stages(ss, kind, mode, rope, G, Hkv, kv, raw, kw, *, block_q, strides, max_blocks) -> None:
    from .._aot_shapes import representatives

    style = rope_style_id(rope)
    D = ss.dims[2]
    for i, (stage, stride) in enumerate(zip(kind.stages, strides)):
        implicit = i == 0
        prev_k = kind.stages[i - 1].k if i else None
        for capacity in (mode.capacities if implicit else (prev_k,)):
            max_chunks = triton.cdiv(capacity, stage.chunk_size)
            Hs = Hkv if ss.mask_heads is None else ss.mask_heads  # scored heads (select_rep_scores)
            Gs = G * Hkv // Hs
            tiles = lambda nb: _tiling(nb, Hs, Gs, block_q, stride, max_chunks, implicit, style)[2]  # noqa: E731
            for nb in representatives(1, max_blocks, tiles):
                raw_keys = (RawKeys(ss.space.fake(nb, Hkv, D, dtype=ss.space.act_dtype), ss.i64(nb))
                            if raw else None)
                candidates = None if implicit else ss.index_rows(nb, prev_k)
                pruning_stage(ss.step_q(nb), kv, ss.tables(nb), ss.i32(nb), ss.i32(nb), ss.i32(nb),
                              candidates, None if implicit else ss.index_lens(nb), chunk_size=stage.chunk_size,
                              k=stage.k, block_q=block_q, query_stride=stride,
                              max_candidates=capacity if implicit else None, rope_style=rope, raw_keys=raw_keys,
                              **kw)
