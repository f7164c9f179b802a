"""Top-p block selection on the device (paper 004 §3.3 and its kernel 4), no host round trip.

Per sequence b with block scores x_0 .. x_{nb-1} (>= 0, from `block_importance`):

1. Sort key of block g, one int64: high 32 bits = ~mono(bits(x_g)), low 32 bits = g, where
   bits is the IEEE-754 bit pattern read as int32 and mono(v) = v if v >= 0 else v ^ 0x7FFFFFFF
   (signed-monotone: -inf < -1 < -0 < +0 < 1 < inf; mono ^ 0x80000000 is the paper's unsigned
   phi). The bitwise not flips the order, so an ascending integer sort gives scores descending,
   equal scores by ascending block index.
2. After the sort (torch.sort of a [B, max_blocks] key matrix, padding keys = INT64_MAX last),
   the scores are decoded back from the keys and the kept prefix is the minimal one reaching p:
       k* = min{k >= 1 : x_(0) + .. + x_(k-1) >= p * total}
          = min(nb, 1 + #{r : inclusive prefix through rank r < p * total})   (float32 scan)
   Ties at the boundary: only the first k* blocks of the sorted order are kept, so of several
   equal scores straddling the boundary the lower block indices stay. p >= 1 keeps every block
   (the minimal-prefix rule would drop zero-mass blocks); p <= 0 or an all-zero sequence keeps
   its first sorted block. `force_retention` keeps instead the
   first round(rho * nb) blocks of the same order.
3. Token i of sequence b (length L) is kept if its block is, or i < A (sinks) or i >= L - n (window).

Outputs (`TokenSelection`): keep mask [T], kept token rows ascending with cu_kept [B + 1] (packed
per sequence; capacity T, tail -1), per-sequence retention ratio. Triton does key packing,
thresholding (grid (B,): a program scans its sorted row) and token expansion; torch does the sort
and the keep-mask prefix sums. Nothing reads device values on the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._triton_utils import next_pow2, use_triton

_INT64_MAX = tl.constexpr(2**63 - 1)  # padding key (sorts last); constexpr so kernels may read it
_SCAN_BLOCK = 1024  # sorted keys per scan step
_EXPAND_BLOCK = 1024  # tokens per expansion program


@dataclass
class TokenSelection:
    """Kept tokens of a packed batch (all on the scores' device)."""

    keep_mask: torch.Tensor  # [T] bool
    kept_idx: torch.Tensor  # [T] int32: kept rows ascending in [0, cu_kept[-1]), then -1
    cu_kept: torch.Tensor  # [B + 1] int32: kept rows per sequence, prefix sums
    retention: torch.Tensor  # [B] float32: kept tokens / tokens (0 for an empty sequence)
    block_keep: torch.Tensor  # [num_blocks_total] bool


# max_blocks (the step's longest chunk in blocks) is not specialized (plugins/aot.py): one binary
# per BLOCK for every chunk length; it only bounds masks and strides the key rows.
@triton.jit(do_not_specialize=["max_blocks"])
def _pack_keys_kernel(
    # inputs
    scores_ptr,  # [num_blocks_total] float32
    cu_blocks_ptr,  # [B + 1] int32
    # outputs
    keys_ptr,  # [B, max_blocks] int64
    # constants
    max_blocks,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    base = tl.load(cu_blocks_ptr + b)
    valid = g < tl.load(cu_blocks_ptr + b + 1) - base
    bits = tl.load(scores_ptr + base + g, mask=valid, other=0.0).to(tl.int32, bitcast=True)
    mono = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # signed order == float order
    key = ((~mono).to(tl.int64) << 32) | g.to(tl.int64)  # descending score, then ascending index
    key = tl.where(valid, key, _INT64_MAX)
    tl.store(keys_ptr + b.to(tl.int64) * max_blocks + g, key, mask=g < max_blocks)


@triton.jit
def _decode_score(key):
    """Inverse of the key packing: the float32 score of a key (0 for the INT64_MAX padding)."""
    mono = ~((key >> 32).to(tl.int32))
    x = tl.where(mono >= 0, mono, mono ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
    return tl.where(key == _INT64_MAX, 0.0, x)


@triton.jit(do_not_specialize=["max_blocks"])
def _select_kernel(
    # inputs
    keys_ptr,  # [B, max_blocks] int64, sorted ascending per row
    cu_blocks_ptr,  # [B + 1] int32
    # outputs
    block_keep_ptr,  # [num_blocks_total] int8
    # constants
    max_blocks,
    p,  # top-p fraction (TOP_P)
    keep_fraction,  # fraction of blocks kept (not TOP_P)
    BLOCK: tl.constexpr,
    TOP_P: tl.constexpr,
):
    b = tl.program_id(0)
    base = tl.load(cu_blocks_ptr + b)
    num_blocks = tl.load(cu_blocks_ptr + b + 1) - base
    row = keys_ptr + b.to(tl.int64) * max_blocks
    if TOP_P:
        total = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
        for start in range(0, num_blocks, BLOCK):
            r = start + tl.arange(0, BLOCK)
            total += tl.sum(_decode_score(tl.load(row + r, mask=r < num_blocks, other=_INT64_MAX)), axis=0)
        threshold = p * total
        carry = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
        below = tl.sum(tl.zeros([BLOCK], tl.int32), axis=0)  # ranks whose prefix is < threshold
        for start in range(0, num_blocks, BLOCK):
            r = start + tl.arange(0, BLOCK)
            x = _decode_score(tl.load(row + r, mask=r < num_blocks, other=_INT64_MAX))
            prefix = carry + tl.cumsum(x, axis=0)
            below += tl.sum(((prefix < threshold) & (r < num_blocks)).to(tl.int32), axis=0)
            carry += tl.sum(x, axis=0)
        num_keep = tl.minimum(below + 1, num_blocks)
    else:
        num_keep = tl.minimum((keep_fraction * num_blocks.to(tl.float32) + 0.5).to(tl.int32), num_blocks)
    for start in range(0, num_blocks, BLOCK):
        r = start + tl.arange(0, BLOCK)
        valid = r < num_blocks
        g = (tl.load(row + r, mask=valid, other=0) & 0x7FFFFFFF).to(tl.int32)
        tl.store(block_keep_ptr + base + g, (r < num_keep).to(tl.int8), mask=valid)


@triton.jit
def _expand_kernel(
    # inputs
    block_keep_ptr,  # [num_blocks_total] int8
    cu_seqlens_ptr,  # [B + 1] int32
    cu_blocks_ptr,  # [B + 1] int32
    # outputs
    keep_ptr,  # [T] int8
    # constants
    num_sink, obs_window, block_size,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # positions in the sequence
    seq_start = tl.load(cu_seqlens_ptr + b)
    seq_len = tl.load(cu_seqlens_ptr + b + 1) - seq_start
    valid = i < seq_len
    blk = tl.load(block_keep_ptr + tl.load(cu_blocks_ptr + b) + i // block_size, mask=valid, other=0)
    keep = (blk != 0) | (i < num_sink) | (i >= seq_len - obs_window)
    tl.store(keep_ptr + seq_start + i, keep.to(tl.int8), mask=valid)


def descending_sort_keys(scores: torch.Tensor, block_idx: torch.Tensor) -> torch.Tensor:
    """Torch form of the int64 sort key (ascending key order = descending score, then index)."""
    bits = scores.float().contiguous().view(torch.int32)
    mono = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return ((~mono).long() << 32) | block_idx.long()


def _finish(keep: torch.Tensor, block_keep: torch.Tensor, cu_seqlens: torch.Tensor) -> TokenSelection:
    """Kept rows, cu_kept and retention from the token keep mask (device ops only)."""
    T = keep.numel()
    inclusive = torch.cumsum(keep, 0, dtype=torch.int32)
    cu_kept = torch.nn.functional.pad(inclusive, (1, 0))[cu_seqlens.long()]
    # kept row t goes to slot (its exclusive prefix); dropped rows go to a discarded slot T
    slot = torch.where(keep, inclusive - 1, T).long()
    kept_idx = torch.full((T + 1,), -1, dtype=torch.int32, device=keep.device)
    kept_idx.scatter_(0, slot, torch.arange(T, dtype=torch.int32, device=keep.device))
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).float()
    retention = (cu_kept[1:] - cu_kept[:-1]).float() / lens.clamp_min(1.0)
    return TokenSelection(keep, kept_idx[:T], cu_kept, retention, block_keep)


def sort_keys_triton(scores: torch.Tensor, cu_blocks: torch.Tensor, max_blocks: int) -> torch.Tensor:
    """Unsorted key matrix [B, max_blocks] int64 (padding INT64_MAX) of packed block scores."""
    assert scores.dtype == torch.float32 and scores.dim() == 1 and scores.is_contiguous()
    assert cu_blocks.dtype == torch.int32 and cu_blocks.is_contiguous()
    B = cu_blocks.numel() - 1
    keys = torch.empty((B, max_blocks), dtype=torch.int64, device=scores.device)
    if B > 0 and max_blocks > 0:
        blk = min(_SCAN_BLOCK, next_pow2(max_blocks))
        _pack_keys_kernel[(B, triton.cdiv(max_blocks, blk))](scores, cu_blocks, keys, max_blocks, BLOCK=blk)
    return keys


def select_triton(scores, cu_blocks, cu_seqlens, *, num_tokens: int, max_seqlen: int, block_size: int,
                  num_sink: int, obs_window: int, p: float | None = None,
                  keep_fraction: float | None = None) -> TokenSelection:
    """Triton launcher shared by `top_p_select` (p) and `force_retention` (keep_fraction)."""
    assert (p is None) != (keep_fraction is None)
    assert scores.dtype == torch.float32 and scores.dim() == 1 and scores.is_contiguous()
    assert cu_blocks.dtype == cu_seqlens.dtype == torch.int32 and cu_blocks.shape == cu_seqlens.shape
    B = cu_seqlens.numel() - 1
    max_blocks = triton.cdiv(max_seqlen, block_size)
    dev = scores.device
    block_keep = torch.zeros(scores.numel(), dtype=torch.int8, device=dev)
    keep = torch.zeros(num_tokens, dtype=torch.int8, device=dev)  # rows past cu_seqlens[-1]: dropped
    if B > 0 and max_blocks > 0:
        blk = min(_SCAN_BLOCK, next_pow2(max_blocks))
        keys = torch.sort(sort_keys_triton(scores, cu_blocks, max_blocks), dim=1).values
        top_p = p is not None and p < 1.0  # p >= 1: keep every block
        _select_kernel[(B,)](
            keys, cu_blocks, block_keep, max_blocks,
            float(p if top_p else 1.0), float(1.0 if keep_fraction is None else keep_fraction),
            BLOCK=blk, TOP_P=top_p,
        )
        _expand_kernel[(B, triton.cdiv(max_seqlen, _EXPAND_BLOCK))](
            block_keep, cu_seqlens, cu_blocks, keep, num_sink, obs_window, block_size,
            BLOCK=min(_EXPAND_BLOCK, next_pow2(max_seqlen)),
        )
    return _finish(keep.view(torch.bool), block_keep.view(torch.bool), cu_seqlens)


def select_ref(scores, cu_blocks, cu_seqlens, *, num_tokens: int, block_size: int, num_sink: int,
               obs_window: int, p: float | None = None, keep_fraction: float | None = None,
               **_) -> TokenSelection:
    """Plain reference: per sequence, Python sort by (-score, index), float64 prefix sums."""
    cu, cub = cu_seqlens.tolist(), cu_blocks.tolist()
    block_keep = torch.zeros(scores.numel(), dtype=torch.bool)
    keep = torch.zeros(num_tokens, dtype=torch.bool)
    for b in range(len(cu) - 1):
        x = scores[cub[b]:cub[b + 1]].double().tolist()
        order = sorted(range(len(x)), key=lambda g: (-x[g], g))
        if keep_fraction is not None:
            num_keep = min(math.floor(keep_fraction * len(x) + 0.5), len(x))
        elif p >= 1.0:
            num_keep = len(x)
        else:
            total, acc, num_keep = sum(x), 0.0, len(x)
            for rank, g in enumerate(order):
                acc += x[g]
                if acc >= p * total:
                    num_keep = rank + 1
                    break
        for g in order[:num_keep]:
            block_keep[cub[b] + g] = True
        L = cu[b + 1] - cu[b]
        i = torch.arange(L)  # positions in the sequence
        keep[cu[b]:cu[b + 1]] = block_keep[cub[b] + i // block_size] | (i < num_sink) | (i >= L - obs_window)
    return _finish(keep.to(scores.device), block_keep.to(scores.device), cu_seqlens)


def top_p_select(scores: torch.Tensor, cu_blocks: torch.Tensor, cu_seqlens: torch.Tensor, p: float, *,
                 num_tokens: int, max_seqlen: int, block_size: int = 64, num_sink: int = 128,
                 obs_window: int = 128) -> TokenSelection:
    """Keep the minimal set of blocks holding fraction p of each sequence's mass, plus the first
    num_sink and last obs_window tokens. Host arguments are shapes only (no device read):
    num_tokens = T, max_seqlen >= the longest sequence (it sizes the sort and the grids).

    >>> scores = torch.tensor([0.1, 0.6, 0.3, 0.5, 0.5])  # two sequences: 3 blocks, 2 blocks
    >>> sel = top_p_select(scores, torch.tensor([0, 3, 5], dtype=torch.int32),
    ...                    torch.tensor([0, 12, 20], dtype=torch.int32), 0.5, num_tokens=20,
    ...                    max_seqlen=12, block_size=4, num_sink=0, obs_window=0)
    >>> sel.block_keep.tolist(), sel.cu_kept.tolist()
    ([False, True, False, True, False], [0, 4, 8])
    """
    fn = select_triton if use_triton(scores) else select_ref
    return fn(scores, cu_blocks, cu_seqlens, num_tokens=num_tokens, max_seqlen=max_seqlen,
              block_size=block_size, num_sink=num_sink, obs_window=obs_window, p=p)


def force_retention(scores: torch.Tensor, cu_blocks: torch.Tensor, cu_seqlens: torch.Tensor, rho: float, *,
                    num_tokens: int, max_seqlen: int, block_size: int = 64, num_sink: int = 128,
                    obs_window: int = 128) -> TokenSelection:
    """Keep the round(rho * nb) highest-scoring blocks of each sequence (ties by index) plus the
    sink and window tokens: a fixed retention for speed benchmarks on random weights."""
    assert 0.0 <= rho <= 1.0
    fn = select_triton if use_triton(scores) else select_ref
    return fn(scores, cu_blocks, cu_seqlens, num_tokens=num_tokens, max_seqlen=max_seqlen,
              block_size=block_size, num_sink=num_sink, obs_window=obs_window, keep_fraction=rho)


def aot_launches(space) -> None:
    """The block selection's variants (plugins/aot.py) for an engine with a token-drop plan
    (infhip/methods/token_drop/runtime/step.py _select): top-p with the plan's p (p >= 1: keep all) and the forced
    retention of benchmarks (infhip.eval.common.set_forced_retention; the keep-all variant, not an engine
    knob, so every token-drop engine holds it). A selection "sequence" is a dropping chunk
    G-aligned in its key list: tail + G to max_num_batched_tokens + G - 1 tokens; the scan and
    expansion widths follow the longest one (one launch per distinct pair of widths)."""
    knobs = space.plan.knobs_of("token_drop")
    if knobs is None:
        return
    from .._aot_shapes import representatives
    from .importance import drop_bounds

    tail, _, min_chunk = drop_bounds(space)
    G = knobs.block_size
    widths = lambda n: (min(_SCAN_BLOCK, next_pow2(triton.cdiv(n, G))), min(_EXPAND_BLOCK, next_pow2(n)))  # noqa: E731
    for n in representatives(min_chunk, space.build.max_num_batched_tokens + G - 1, widths):
        nb = triton.cdiv(n, G)
        args = (space.fake(nb, dtype=torch.float32), space.fake(2, dtype=torch.int32), space.fake(2, dtype=torch.int32))
        kw = dict(num_tokens=n, max_seqlen=n, block_size=G, num_sink=0, obs_window=tail)
        top_p_select(*args, knobs.p, **kw)
        if knobs.p < 1.0:  # p >= 1 already launched the variant forced retention uses
            force_retention(*args, 0.5, **kw)
