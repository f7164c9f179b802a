"""Dynamic RoPE for InfiniteHiP: re-rotate cached keys and queries to style-chosen positions.

The KV cache holds keys already rotated (neox "rotate half", plugins/rope.py) at their original
position p, and queries arrive rotated at theirs. A rotation is a group action,
R(p_new) x = R(p_new - p) R(p) x, so moving a vector to a new position p_new only needs the
delta  delta = p_new - p:

    angle[j] = delta * inv_freq[j]                       (j < D/2; float64, reduced mod 2 pi)
    out      = x * cos(angle[j % half]) + sign * x_rot * sin(angle[j % half])
    x_rot[j] = x[j + half] (j < half) | x[j - half] (j >= half),  sign = -1 | +1

(attention_scaling is already in the stored vectors and a rotation keeps it.)

Styles (paper 000, "Dynamic RoPE"; positions are relative to nothing else, only differences
matter inside a dot product):

    NONE           keep the stored rotation (original positions; inside the trained window)
    RELATIVE       pruning, layers >= 4: every query at n_stream + 1, SelectRep's left-branch
                   representative at 0 and right-branch one at 1 (distances n_stream + 1, n_stream)
    CHUNK_INDEXED  pruning, layers 1-3: a key at the index c of its chunk in this stage, a query
                   at min(p, num_chunks + n_stream) (the newest chunk n_stream + 1 behind it)
    STREAMING      block-sparse attention: the keys of the block's set at their rank 0, 1, ...
                   in original order, a query at the rank of its own token (StreamingLLM)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NONE, RELATIVE, CHUNK_INDEXED, STREAMING = 0, 1, 2, 3
# the same ids for kernels (compiled Triton reads only constexpr globals)
C_NONE, C_RELATIVE = tl.constexpr(NONE), tl.constexpr(RELATIVE)
C_CHUNK_INDEXED, C_STREAMING = tl.constexpr(CHUNK_INDEXED), tl.constexpr(STREAMING)
_NAMES = {"none": NONE, "relative": RELATIVE, "chunk_indexed": CHUNK_INDEXED, "streaming": STREAMING}


def rope_style_id(style: str | int) -> int:
    """'none' | 'relative' | 'chunk_indexed' | 'streaming' (or the id itself) -> int id."""
    if isinstance(style, int):
        assert style in _NAMES.values(), f"unknown rope style id {style}"
        return style
    assert style in _NAMES, f"unknown rope style {style!r}; one of {sorted(_NAMES)}"
    return _NAMES[style]


@triton.jit
def _sin_cos(a):
    """sin and cos of a float32 angle already reduced to [-pi, pi] (Taylor to x^17 / x^18, error
    < 5e-7): libdevice's sinf/cosf carry a large-argument path that, inlined for every element,
    makes the kernels megabytes big."""
    a2 = a * a
    s = a2 * 2.8114572543455206e-15 + -7.647163731819816e-13
    s = s * a2 + 1.6059043836821613e-10
    s = s * a2 + -2.505210838544172e-08
    s = s * a2 + 2.7557319223985893e-06
    s = s * a2 + -0.0001984126984126984
    s = s * a2 + 0.008333333333333333
    s = s * a2 + -0.16666666666666666
    s = s * a2 + 1.0
    c = a2 * -1.5619206968586225e-16 + 4.779477332387385e-14
    c = c * a2 + -1.1470745597729725e-11
    c = c * a2 + 2.08767569878681e-09
    c = c * a2 + -2.755731922398589e-07
    c = c * a2 + 2.48015873015873e-05
    c = c * a2 + -0.001388888888888889
    c = c * a2 + 0.041666666666666664
    c = c * a2 + -0.5
    c = c * a2 + 1.0
    return a * s, c


@triton.jit
def sin_cos_of(delta, inv_freq_ptr, head_dim, BLOCK_D: tl.constexpr):
    """sin, cos [R, BLOCK_D // 2] float32 of the angles delta[r] * inv_freq[j] (int delta [R]):
    one angle per frequency; both halves of a row share them (load_rotated_by)."""
    j = tl.arange(0, BLOCK_D // 2)
    freq = tl.load(inv_freq_ptr + j, mask=j < head_dim // 2, other=0.0)
    # float64 product and reduction to [-pi, pi]: deltas reach 1e6+ at long context
    angle = delta.to(tl.float64)[:, None] * freq.to(tl.float64)[None, :]
    turns = tl.floor(angle * 0.15915494309189535 + 0.5)  # round(angle / 2 pi)
    angle = (angle - turns * 6.283185307179586).to(tl.float32)
    return _sin_cos(angle)


@triton.jit
def run_sin_cos(delta, inv_freq_ptr, head_dim, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                GROUP: tl.constexpr):
    """sin, cos [BLOCK_N, BLOCK_D // 2] of the position deltas [BLOCK_N] of BLOCK_N rows, computed
    once per aligned group of GROUP rows when every group shares one delta, else per row. Same
    values either way; only the trig work differs. (STREAMING keys move by rank - token: 0 in the
    sink, one shift in the stream, one shift per run of consecutive selected tokens.)"""
    if GROUP > 1:
        runs = tl.reshape(delta, (BLOCK_N // GROUP, GROUP))
        run_delta = tl.min(runs, axis=1)  # [BLOCK_N // GROUP]
        if tl.max(tl.max(runs, axis=1) - run_delta, axis=0) == 0:
            sin, cos = sin_cos_of(run_delta, inv_freq_ptr, head_dim, BLOCK_D)  # [BLOCK_N // GROUP, BLOCK_D // 2]
            shape: tl.constexpr = (BLOCK_N // GROUP, GROUP, BLOCK_D // 2)
            sin = tl.reshape(tl.broadcast_to(sin[:, None, :], shape), (BLOCK_N, BLOCK_D // 2))
            cos = tl.reshape(tl.broadcast_to(cos[:, None, :], shape), (BLOCK_N, BLOCK_D // 2))
        else:
            sin, cos = sin_cos_of(delta, inv_freq_ptr, head_dim, BLOCK_D)
    else:
        sin, cos = sin_cos_of(delta, inv_freq_ptr, head_dim, BLOCK_D)
    return sin, cos


@triton.jit
def _join_halves(a, b):
    """[R, H], [R, H] -> [R, 2H] = [a | b] (row-wise concatenation)."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (a.shape[0], 2 * a.shape[1]))


@triton.jit
def load_halves(row_ptrs, row_mask, head_dim, BLOCK_D: tl.constexpr):
    """The two halves [R, BLOCK_D // 2] float32 of rows (row_ptrs [R]: element 0 of each row,
    unit stride; head_dim == BLOCK_D, a power of two), for rotate_halves."""
    j = tl.arange(0, BLOCK_D // 2)
    mask = row_mask[:, None] & (j < head_dim // 2)[None, :]
    x1 = tl.load(row_ptrs[:, None] + j[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row_ptrs[:, None] + (head_dim // 2 + j)[None, :], mask=mask, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def rotate_halves(x1, x2, sin, cos):
    """Rows [R, 2H] = [x1 cos - x2 sin | x2 cos + x1 sin] from halves [R, H] and sin/cos [R or 1, H]
    (sin_cos_of): each half is loaded once and rotated with the other."""
    return _join_halves(x1 * cos - x2 * sin, x2 * cos + x1 * sin)


@triton.jit
def load_rotated_by(row_ptrs, row_mask, sin, cos, head_dim, BLOCK_D: tl.constexpr):
    """Load rows [R, BLOCK_D] (row_ptrs [R]: element 0 of each row, unit stride; head_dim ==
    BLOCK_D, a power of two) rotated by the given sin/cos [R or 1, BLOCK_D // 2] (sin_cos_of);
    float32 result."""
    x1, x2 = load_halves(row_ptrs, row_mask, head_dim, BLOCK_D)
    return rotate_halves(x1, x2, sin, cos)


@triton.jit
def load_rotated(row_ptrs, row_mask, delta, inv_freq_ptr, head_dim,
                 BLOCK_D: tl.constexpr, ROTATE: tl.constexpr):
    """Load rows [R, BLOCK_D] (row_ptrs [R]: address of element 0 of each row, unit stride) and,
    when ROTATE, rotate row r by the position delta[r] (int [R]); float32 result."""
    if ROTATE:
        sin, cos = sin_cos_of(delta, inv_freq_ptr, head_dim, BLOCK_D)
        x = load_rotated_by(row_ptrs, row_mask, sin, cos, head_dim, BLOCK_D)
    else:
        d = tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (d < head_dim)[None, :]
        x = tl.load(row_ptrs[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    return x


def check_rotatable(head_dim: int) -> None:
    """The kernels rotate a row as two halves of a power-of-two tile (load_rotated_by)."""
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, (
        f"dynamic RoPE needs a power-of-two head_dim >= 16, got {head_dim}; use rope styles 'none'")


def rotate_by_ref(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Reference: rotate x [N, H, D] (or [N, D]) by the position deltas [N]; float64 result."""
    half = x.shape[-1] // 2
    angle = delta.double()[:, None] * inv_freq.double()[None, :]  # [N, D/2]
    cos, sin = angle.cos(), angle.sin()
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
