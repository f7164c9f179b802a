"""Block importance at a UniPrefill anchor layer (paper 004 §3.2; its kernels 1-3, fused).

Packed variable-length batch: sequence b owns rows cu_seqlens[b]:cu_seqlens[b+1] of
q [T, Hq, D] and k [T, Hkv, D] (RoPE applied; GQA: head h reads kv head h // (Hq / Hkv)).
With L its length and n_b = min(n, L) observation rows at positions i = L - n_b .. L - 1:

    S[h, i, j] = scale * q[i, h] . k[j, h // group]                    for keys j <= i (causal)
    P[h, i, j] = exp(S[h, i, j]) / sum_{j' <= i} exp(S[h, i, j'])      softmax over the FULL length
    o[j]       = sum_h (1 / n_b) sum_i P[h, i, j]                      mean over rows, sum over heads
    score[g]   = mean_{j in block g} o[j],   block g = [g G, min((g + 1) G, L))  (last one partial)

Scores are packed: sequence b owns score[cu_blocks[b]:cu_blocks[b+1]], cu_blocks being the
prefix sums of ceil(L_b / G). Per sequence, sum_g score[g] * |block g| = Hq.

Two Triton passes; the n x L probabilities only ever exist tile by tile in registers:

* pass 1, row statistics, grid (B, Hq * row tiles, NUM_SPLITS): BLOCK_M window rows of one
  head against a contiguous share of the key tiles, online softmax in base 2 (s = S log2 e):
  m = max_j s_j, l = sum_j 2^(s_j - m). Split partials merge as M = max_s m_s,
  l = sum_s l_s 2^(m_s - M) into lse = M + log2 l; state is [B, Hq, n, NUM_SPLITS] floats.
* pass 2, block sums, grid (B, key tiles): a tile is BLOCKS_PER_TILE whole blocks of G keys; its
  program loops over every head and window row, recomputes s, accumulates 2^(s - lse) per key
  column, and reduces the columns to block means. Each block belongs to exactly one program,
  so there are no atomics and the result is deterministic.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .._triton_utils import device_num_sms, dot_precision, next_pow2, use_triton
from ..aot import recording_target

_LOG2E = 1.4426950408889634
_KEYS_PER_TILE = 64  # pass-2 tile width target (whole blocks); pass-1 key tile


@triton.jit
def _row_stats_kernel(
    # inputs
    q_ptr,  # [T, Hq, D], last dim contiguous
    k_ptr,  # [T, Hkv, D], last dim contiguous
    cu_seqlens_ptr,  # [B + 1] int32
    q_start_ptr,  # [B] int32: q row of window row 0 of each sequence
    # outputs
    m_ptr,  # [B, Hq, n, NUM_SPLITS] float32: max of s (or lse when NUM_SPLITS == 1)
    l_ptr,  # [B, Hq, n, NUM_SPLITS] float32: sum of 2^(s - m) (unused when NUM_SPLITS == 1)
    # constants
    stride_qt, stride_qh, stride_kt, stride_kh,
    num_q_heads, group_size, head_dim,
    obs_window,  # n
    scale_log2,  # scale * log2(e)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,  # upcast dot operands (Triton's interpreter mis-multiplies bf16)
):
    b = tl.program_id(0)
    h = tl.program_id(1) % num_q_heads
    row_tile = tl.program_id(1) // num_q_heads
    split = tl.program_id(2)
    seq_start = tl.load(cu_seqlens_ptr + b)
    seq_len = tl.load(cu_seqlens_ptr + b + 1) - seq_start
    num_rows = tl.minimum(obs_window, seq_len)  # n_b

    r = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # window rows
    row_valid = r < num_rows
    row_pos = seq_len - num_rows + r  # position in the sequence
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q_start = tl.load(q_start_ptr + b)
    q = tl.load(q_ptr + (q_start + r).to(tl.int64)[:, None] * stride_qt + h * stride_qh
                + d[None, :], mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    k_head = k_ptr + (h // group_size) * stride_kh

    # this split's share of the key tiles (none for a row tile past the window)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * per_split
    tile_hi = tl.where(row_tile * BLOCK_M < num_rows, tl.minimum(tile_lo + per_split, num_tiles), 0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    for tile in range(tile_lo, tile_hi):
        j = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # key positions
        k = tl.load(k_head + (seq_start + j).to(tl.int64)[:, None] * stride_kt + d[None, :],
                    mask=(j < seq_len)[:, None] & d_mask[None, :], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        visible = row_valid[:, None] & (j[None, :] <= row_pos[:, None])  # causal (j <= i < L)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows seeing no key yet
        l = l * tl.exp2(m - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), axis=1)
        m = m_new

    out = ((b * num_q_heads + h) * obs_window + r).to(tl.int64) * NUM_SPLITS + split
    if NUM_SPLITS == 1:
        lse = tl.where(l > 0.0, m + tl.log2(tl.where(l > 0.0, l, 1.0)), float("-inf"))  # -inf: no row
        tl.store(m_ptr + out, lse, mask=r < obs_window)
    else:
        tl.store(m_ptr + out, m, mask=r < obs_window)
        tl.store(l_ptr + out, l, mask=r < obs_window)


@triton.jit
def _block_scores_kernel(
    # inputs
    q_ptr,  # [T, Hq, D], last dim contiguous
    k_ptr,  # [T, Hkv, D], last dim contiguous
    cu_seqlens_ptr,  # [B + 1] int32
    cu_blocks_ptr,  # [B + 1] int32
    q_start_ptr,  # [B] int32: q row of window row 0 of each sequence
    lse_ptr,  # [B, Hq, n] float32, base-2 log-sum-exp of each window row
    # outputs
    scores_ptr,  # [num_blocks_total] float32
    # constants
    stride_qt, stride_qh, stride_kt, stride_kh,
    num_q_heads, num_kv_heads, group_size, head_dim,
    obs_window,  # n
    block_size,  # G
    blocks_per_tile,  # whole blocks per program; blocks_per_tile * G <= BLOCK_N
    scale_log2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    seq_start = tl.load(cu_seqlens_ptr + b)
    seq_len = tl.load(cu_seqlens_ptr + b + 1) - seq_start
    num_rows = tl.minimum(obs_window, seq_len)
    q_start = tl.load(q_start_ptr + b)
    keys_per_tile = blocks_per_tile * block_size

    lane = tl.arange(0, BLOCK_N)
    j = tile * keys_per_tile + lane  # key positions
    key_valid = (lane < keys_per_tile) & (j < seq_len)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    num_row_tiles = tl.cdiv(num_rows, BLOCK_M)
    # tiles past this sequence's end (shorter sequences of the batch) do no work
    num_kv_loop = tl.where(tile * keys_per_tile < seq_len, num_kv_heads, 0)

    col = tl.zeros([BLOCK_N], tl.float32)  # sum over heads and rows of P[h, i, j]
    for kv_head in range(0, num_kv_loop):
        k = tl.load(k_ptr + (seq_start + j).to(tl.int64)[:, None] * stride_kt + kv_head * stride_kh
                    + d[None, :], mask=key_valid[:, None] & d_mask[None, :], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        for step in range(0, group_size * num_row_tiles):
            h = kv_head * group_size + step // num_row_tiles
            r = (step % num_row_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
            row_valid = r < num_rows
            row_pos = seq_len - num_rows + r
            q = tl.load(q_ptr + (q_start + r).to(tl.int64)[:, None] * stride_qt
                        + h * stride_qh + d[None, :],
                        mask=row_valid[:, None] & d_mask[None, :], other=0.0)
            if DOT_F32:
                q = q.to(tl.float32)
            lse = tl.load(lse_ptr + (b * num_q_heads + h) * obs_window + r, mask=row_valid, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            visible = row_valid[:, None] & key_valid[None, :] & (j[None, :] <= row_pos[:, None])
            col += tl.sum(tl.where(visible, tl.exp2(s - lse[:, None]), 0.0), axis=0)
    col = col / tl.maximum(num_rows, 1).to(tl.float32)

    # key columns -> block means (a one-hot reduction: G need not be a power of two)
    blk = tl.arange(0, BLOCK_B)
    in_block = ((lane // block_size)[:, None] == blk[None, :]) & key_valid[:, None]  # [BLOCK_N, BLOCK_B]
    block_sum = tl.sum(tl.where(in_block, col[:, None], 0.0), axis=0)
    count = tl.sum(in_block.to(tl.int32), axis=0)
    g = tile * blocks_per_tile + blk
    store = (blk < blocks_per_tile) & (g < tl.cdiv(seq_len, block_size))
    block_base = tl.load(cu_blocks_ptr + b)
    tl.store(scores_ptr + block_base + g, block_sum / tl.maximum(count, 1).to(tl.float32), mask=store)


def block_layout(cu_seqlens: torch.Tensor, block_size: int) -> torch.Tensor:
    """cu_blocks [B + 1] int32: prefix sums of ceil(L_b / G), computed on the device (no sync)."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    num_blocks = torch.div(lens + block_size - 1, block_size, rounding_mode="floor")
    return torch.nn.functional.pad(torch.cumsum(num_blocks, 0), (1, 0)).to(torch.int32)


def choose_num_splits(batch: int, num_q_heads: int, num_row_tiles: int, max_tiles: int,
                      num_sms: int) -> int:
    """Key splits of pass 1 so that its grid fills ~2 waves of SMs; a shape-only choice."""
    want = triton.cdiv(2 * num_sms, max(batch * num_q_heads * num_row_tiles, 1))
    return max(1, min(want, max_tiles, 64))


def _window_q_start(cu_seqlens: torch.Tensor, obs_window: int, q_window: bool) -> torch.Tensor:
    """[B] int32 q row of each sequence's first window row (device ops, no sync): the window
    rows inside the packed q, or, with q_window, the prefix sums of the window sizes."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    rows = torch.clamp(lens, max=obs_window)
    if q_window:
        return (torch.cumsum(rows, 0) - rows).to(torch.int32)
    return (cu_seqlens[1:] - rows).to(torch.int32)


def _check_q_rows(q: torch.Tensor, lens: list[int], obs_window: int, q_window: bool, num_keys: int) -> None:
    want = sum(min(obs_window, x) for x in lens) if q_window else num_keys
    assert q.shape[0] == want, (f"q has {q.shape[0]} rows, expected {want} "
                                f"({'the packed windows' if q_window else 'one per key'})")


def block_importance_triton(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                            obs_window: int, block_size: int,
                            cu_seqlens_list: list[int] | None = None,
                            num_splits: int | None = None,
                            q_window: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher for `block_importance` (num_splits: tuning/test override)."""
    Hq, D = q.shape[1:]
    T, Hkv, Dk = k.shape
    assert Dk == D and Hq % Hkv == 0, "q [., Hq, D] vs k [T, Hkv, D] mismatch"
    assert q.stride(2) == 1 and k.stride(2) == 1, "last dims must be contiguous"
    assert q.dtype == k.dtype, "q and k dtypes must match (tl.dot)"
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1 and cu_seqlens.is_contiguous()
    assert obs_window >= 1 and block_size >= 1
    B = cu_seqlens.numel() - 1
    cu = cu_seqlens_list if cu_seqlens_list is not None else cu_seqlens.tolist()  # host shapes
    assert len(cu) == B + 1 and cu[-1] <= T
    lens = [cu[i + 1] - cu[i] for i in range(B)]
    _check_q_rows(q, lens, obs_window, q_window, T)
    q_start = _window_q_start(cu_seqlens, obs_window, q_window)
    max_len = max(lens, default=0)
    cu_blocks = block_layout(cu_seqlens, block_size)
    scores = torch.empty(sum(triton.cdiv(x, block_size) for x in lens), dtype=torch.float32,
                         device=q.device)
    if max_len == 0:
        return scores, cu_blocks

    BLOCK_D = max(16, next_pow2(D))
    BLOCK_M = min(64, max(16, next_pow2(min(obs_window, max_len))))
    BLOCK_N = _KEYS_PER_TILE
    num_row_tiles = triton.cdiv(min(obs_window, max_len), BLOCK_M)
    if num_splits is None:
        num_splits = choose_num_splits(B, Hq, num_row_tiles, triton.cdiv(max_len, BLOCK_N),
                                       device_num_sms(q.device))
    gpu = q.is_cuda or recording_target() is not None  # recording for a GPU target: its choices
    precision = dot_precision(q.dtype if gpu else torch.float32)
    m_part = torch.empty((B, Hq, obs_window, num_splits), dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part) if num_splits > 1 else m_part
    _row_stats_kernel[(B, Hq * num_row_tiles, num_splits)](
        q, k, cu_seqlens, q_start,
        m_part, l_part,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        Hq, Hq // Hkv, D, obs_window, float(scale) * _LOG2E,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, NUM_SPLITS=num_splits,
        DOT_PRECISION=precision, DOT_F32=not gpu, num_warps=4,
    )
    if num_splits == 1:
        lse = m_part[..., 0]
    else:  # merge the split partials: B * Hq * n * NUM_SPLITS floats, a few tiny torch ops
        m_max = m_part.amax(-1, keepdim=True)
        m_max = torch.where(torch.isfinite(m_max), m_max, torch.zeros_like(m_max))
        lse = m_max[..., 0] + torch.log2((l_part * torch.exp2(m_part - m_max)).sum(-1))

    blocks_per_tile = max(1, _KEYS_PER_TILE // block_size)
    keys_per_tile = blocks_per_tile * block_size
    _block_scores_kernel[(B, triton.cdiv(max_len, keys_per_tile))](
        q, k, cu_seqlens, cu_blocks, q_start, lse.contiguous(),
        scores,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        Hq, Hkv, Hq // Hkv, D, obs_window, block_size, blocks_per_tile, float(scale) * _LOG2E,
        BLOCK_M=BLOCK_M, BLOCK_N=max(16, next_pow2(keys_per_tile)), BLOCK_B=next_pow2(blocks_per_tile),
        BLOCK_D=BLOCK_D, DOT_PRECISION=precision, DOT_F32=not gpu, num_warps=4,
    )
    return scores, cu_blocks


def block_importance_ref(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                         obs_window: int, block_size: int,
                         cu_seqlens_list: list[int] | None = None,
                         q_window: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch float64 reference: the explicit n_b x L softmax of each sequence."""
    cu = cu_seqlens_list if cu_seqlens_list is not None else cu_seqlens.tolist()
    group = q.shape[1] // k.shape[1]
    lens = [cu[b + 1] - cu[b] for b in range(len(cu) - 1)]
    _check_q_rows(q, lens, obs_window, q_window, k.shape[0])
    q_start = _window_q_start(cu_seqlens, obs_window, q_window).tolist()
    out = []
    for b in range(len(cu) - 1):
        L = cu[b + 1] - cu[b]
        if L == 0:
            continue
        n_b = min(obs_window, L)
        qw = q[q_start[b]:q_start[b] + n_b].double()  # [n_b, Hq, D]
        kb = k[cu[b]:cu[b + 1]].double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        s = torch.einsum("ihd,jhd->hij", qw, kb) * scale
        i_pos = torch.arange(L - n_b, L, device=q.device)[:, None]
        s = s.masked_fill(torch.arange(L, device=q.device)[None, :] > i_pos, -math.inf)
        o = torch.softmax(s, dim=-1).mean(dim=1).sum(dim=0)  # [L]
        pad = (-L) % block_size
        o = torch.cat([o, o.new_zeros(pad)]).view(-1, block_size).sum(-1)
        counts = torch.full_like(o, block_size)
        counts[-1] = block_size - pad
        out.append(o / counts)
    scores = torch.cat(out).float() if out else q.new_zeros(0, dtype=torch.float32)
    return scores, block_layout(cu_seqlens, block_size)


def block_importance(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                     obs_window: int = 128, block_size: int = 64,
                     cu_seqlens_list: list[int] | None = None,
                     q_window: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Block scores of packed sequences: returns (scores [num_blocks_total] float32, cu_blocks [B + 1]).

    cu_seqlens_list (host copy of cu_seqlens) sizes the grid and the output; without it the
    launcher reads cu_seqlens once (a host sync). With q_window, q holds only the window rows:
    [sum_b min(n, L_b), Hq, D], sequence b's n_b rows packed in order (a chunked prefill scores
    its last n queries against keys gathered from the whole cache, which q need not span).

    >>> q, k = torch.randn(40, 4, 16), torch.randn(40, 2, 16)
    >>> cu = torch.tensor([0, 30, 40], dtype=torch.int32)
    >>> scores, cu_blocks = block_importance(q, k, cu, 0.25, obs_window=8, block_size=8)
    >>> scores.shape, cu_blocks.tolist()
    (torch.Size([6]), [0, 4, 6])
    """
    if use_triton(q, k):
        return block_importance_triton(q, k, cu_seqlens, scale, obs_window, block_size, cu_seqlens_list,
                                       q_window=q_window)
    return block_importance_ref(q, k, cu_seqlens, scale, obs_window, block_size, cu_seqlens_list,
                                q_window=q_window)


def drop_bounds(space) -> tuple[int, int, int]:
    """(kept tail, most dropping chunks of a step, fewest tokens of a dropping chunk) of the
    engine's token-drop plan (infhip/methods/token_drop/runtime/step.py: keep_tail, plan_drops): a dropping chunk
    has at least G droppable tokens besides the kept tail, and the step's chunks share
    max_num_batched_tokens."""
    knobs, model, build = space.plan.knobs_of("token_drop"), space.model, space.build
    windows = [model.window_of(i) for i in range(model.num_layers)]
    tail = max([knobs.obs_window] + [w for w in windows if w is not None])
    min_chunk = tail + knobs.block_size
    return tail, max(1, min(build.max_batch_size, build.max_num_batched_tokens // min_chunk)), min_chunk


def aot_launches(space) -> None:
    """block_importance's variants (plugins/aot.py) for an engine with a token-drop plan: at each
    anchor the window queries of the step's dropping chunks (1 to drop_bounds' most) score every
    key their layer holds (a key list of at least one dropping chunk's tokens, up to
    max_seq_len). Pass 1's split count depends on the chunk count and the longest key list: one
    launch per distinct count; everything else is fixed by the model and the plan."""
    knobs = space.plan.knobs_of("token_drop")
    if knobs is None:
        return
    from .._aot_shapes import representatives

    m = space.model
    _, max_chunks, min_keys = drop_bounds(space)
    n, G = knobs.obs_window, knobs.block_size
    block_m = min(64, max(16, next_pow2(n)))  # min(n, longest list) = n: a list holds >= tail + G > n keys
    row_tiles = triton.cdiv(n, block_m)
    seen = set()
    max_tiles = triton.cdiv(space.build.max_seq_len, _KEYS_PER_TILE)
    for b in range(1, max_chunks + 1):
        splits = lambda t: choose_num_splits(b, m.num_heads, row_tiles, t, space.target.num_sms)  # noqa: E731
        for tiles in representatives(triton.cdiv(min_keys, _KEYS_PER_TILE), max_tiles, splits):
            if splits(tiles) in seen:
                continue
            seen.add(splits(tiles))
            L = max(min_keys, tiles * _KEYS_PER_TILE)  # each of the b key lists this long
            cu = [i * L for i in range(b + 1)]
            q = space.fake(b * n, m.num_heads, m.head_dim, dtype=space.act_dtype)  # the packed windows
            k = space.fake(b * L, m.num_kv_heads, m.head_dim, dtype=space.act_dtype)
            block_importance(q, k, space.fake(b + 1, dtype=torch.int32), m.attention_scale, n, G,
                             cu_seqlens_list=cu, q_window=True)
