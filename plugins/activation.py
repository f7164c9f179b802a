"""Gated MLP activation: act(gate) * up on a fused gate_up projection.

gate_up is [T, 2*I] with gate = gate_up[:, :I], up = gate_up[:, I:]; the output
is [T, I] in gate_up.dtype, computed in float32.

    silu(g)      = g * sigmoid(g)
    gelu_tanh(g) = 0.5 * g * (1 + tanh(sqrt(2/pi) * (g + 0.044715 g^3)))
                 = g * sigmoid(2 * sqrt(2/pi) * (g + 0.044715 g^3))

The sigmoid form of gelu_tanh avoids tanh, which Triton only exposes through
backend-specific libdevice calls; sigmoid is evaluated from exp(-|z|) so it never
overflows and saturates cleanly to 0 or 1 for large |z|.

Fused fp8 output (``quantize=True``, fp8-weight engines whose down_proj runs torch._scaled_mm;
plugins/fp8_linear.py): instead of the [T, I] row the kernel writes it quantized per row, e4m3
with one float32 scale (an `Fp8Act`), from the row as rounded to gate_up.dtype, with
quantize_act's rule and helpers: the same bytes as quantize_act(gated_act(gate_up)). A row's
scale needs the whole row, so the fused grid is one program per row: up to MAX_ROW_BLOCK
columns held in registers (one pass over gate_up), wider rows in tiles of ROW_TILE, twice (the
amax, then act recomputed from the re-read, mostly L2-resident, gate_up row and stored).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._triton_utils import next_pow2, use_triton
from .fp8_linear import Fp8Act, quantize_act_ref, row_scale_e4m3, to_e4m3_grid
from .kv_quant import FP8_DTYPE

_KINDS = {"silu": 0, "gelu_tanh": 1}
BLOCK = 1024  # columns per program of the plain output
MAX_ROW_BLOCK = 16384  # fused fp8 output: rows up to this wide stay in registers (Llama-8B's I = 14336)
ROW_TILE = 4096  # fused fp8 output, wider rows: tile width of the two passes


@triton.jit
def _gated_tile(row, cols, mask, I, KIND: tl.constexpr):
    """act(gate) * up for columns cols of one gate_up row (row: pointer to its start), in float32
    and rounded to the row's dtype (zeros where not mask) -> (float32 [B], the dtype's [B])."""
    g_raw = tl.load(row + cols, mask=mask, other=0.0)
    g = g_raw.to(tl.float32)
    u = tl.load(row + I + cols, mask=mask, other=0.0).to(tl.float32)
    if KIND == 0:
        z = g
    else:
        z = 1.5957691216057308 * (g + 0.044715 * g * g * g)  # 2 * sqrt(2/pi) * (...)
    e = tl.exp(-tl.abs(z))  # in (0, 1]: no overflow for large |z|
    act = g * tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))  # g * sigmoid(z)
    y = (act * u).to(g_raw.dtype)
    return y.to(tl.float32), y


@triton.jit
def _gated_act_kernel(
    # inputs
    gate_up_ptr,  # [T, 2*I], last dim contiguous
    # outputs
    out_ptr,  # [T, I] contiguous, gate_up dtype; dummy when QUANT
    q_ptr,  # QUANT: [T, I] float8_e4m3fn contiguous; else dummy
    q_scale_ptr,  # QUANT: [T] float32; else dummy
    # constants
    stride_in,  # row stride of gate_up
    I,
    BLOCK: tl.constexpr,  # columns per program (not QUANT), per tile (QUANT)
    KIND: tl.constexpr,  # 0 = silu, 1 = gelu_tanh
    QUANT: tl.constexpr,  # write rows as e4m3 + scale; grid (T, 1): one program per row
    ONE_TILE: tl.constexpr,  # QUANT: BLOCK >= I (the row in registers, one pass)
):
    t = tl.program_id(0)
    row = gate_up_ptr + t.to(tl.int64) * stride_in
    if not QUANT:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        _, y = _gated_tile(row, cols, mask, I, KIND)
        tl.store(out_ptr + t.to(tl.int64) * I + cols, y, mask=mask)
    else:
        ks = tl.arange(0, BLOCK)
        q_row = q_ptr + t.to(tl.int64) * I
        if ONE_TILE:
            yf, _ = _gated_tile(row, ks, ks < I, I, KIND)
            s = row_scale_e4m3(tl.abs(yf))  # [BLOCK], every entry the row's scale
            tl.store(q_row + ks, to_e4m3_grid(yf, s).to(q_ptr.dtype.element_ty), mask=ks < I)
        else:
            amax = tl.zeros((BLOCK,), dtype=tl.float32)
            for k0 in range(0, I, BLOCK):  # pass 1: the row's amax
                yf, _ = _gated_tile(row, k0 + ks, k0 + ks < I, I, KIND)
                amax = tl.maximum(amax, tl.abs(yf))
            s = row_scale_e4m3(amax)
            for k0 in range(0, I, BLOCK):  # pass 2: the same values again, quantized
                yf, _ = _gated_tile(row, k0 + ks, k0 + ks < I, I, KIND)
                tl.store(q_row + k0 + ks, to_e4m3_grid(yf, s).to(q_ptr.dtype.element_ty), mask=k0 + ks < I)
        tl.store(q_scale_ptr + t + ks, s, mask=ks == 0)


def _fused_launch(I: int) -> tuple[int, bool, int]:
    """(BLOCK, ONE_TILE, num_warps) of the fp8-output form for rows of width I."""
    if I <= MAX_ROW_BLOCK:
        block = next_pow2(I)
        return block, True, 16 if block >= 8192 else 8 if block >= 2048 else 4
    return ROW_TILE, False, 8


def gated_act_triton(gate_up: torch.Tensor, kind: str, quantize: bool = False):
    """Triton launcher; same contract as `gated_act`."""
    assert kind in _KINDS, f"unknown activation {kind!r}"
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, "gate_up must be [T, 2*I]"
    assert gate_up.stride(1) == 1, "gate_up: last dim must be contiguous"
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    if quantize:  # the rows go out as e4m3 + scales only; `out` is a dummy
        q = torch.empty((T, I), dtype=FP8_DTYPE, device=gate_up.device)
        q_scale = torch.empty((T,), dtype=torch.float32, device=gate_up.device)
        out = q
        block, one_tile, num_warps = _fused_launch(I)
        grid = (T, 1)
    else:
        out = torch.empty((T, I), dtype=gate_up.dtype, device=gate_up.device)
        q, q_scale = out, out  # dummies, never touched
        block, one_tile, num_warps = min(next_pow2(I), BLOCK), False, 4
        grid = (T, triton.cdiv(I, block))
    if T > 0:
        _gated_act_kernel[grid](gate_up, out, q, q_scale, gate_up.stride(0), I,
                                BLOCK=block, KIND=_KINDS[kind], QUANT=quantize, ONE_TILE=one_tile,
                                num_warps=num_warps)
    return Fp8Act(q, q_scale, gate_up.dtype) if quantize else out


def gated_act_ref(gate_up: torch.Tensor, kind: str, quantize: bool = False):
    """Plain-torch reference (float32 math); quantize: the output through quantize_act's
    reference (an `Fp8Act`)."""
    I = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :I].float(), gate_up[..., I:].float()
    if kind == "silu":
        act = F.silu(gate)
    elif kind == "gelu_tanh":
        act = F.gelu(gate, approximate="tanh")
    else:
        raise ValueError(f"unknown activation {kind!r}")
    y = (act * up).to(gate_up.dtype)
    return Fp8Act(*quantize_act_ref(y), gate_up.dtype) if quantize else y


def gated_act(gate_up: torch.Tensor, kind: str, quantize: bool = False):
    """act(gate_up[:, :I]) * gate_up[:, I:], kind in {"silu", "gelu_tanh"}; quantize: as an
    `Fp8Act` (e4m3 rows + float32 scales) for an fp8 down_proj's scaled_mm path
    (plugins/fp8_linear.py takes_fp8_act)."""
    if use_triton(gate_up):
        return gated_act_triton(gate_up, kind, quantize)
    return gated_act_ref(gate_up, kind, quantize)


def aot_launches(space) -> None:
    """The launches the runtime makes (plugins/aot.py): the MLP's act(gate) * up on the fused
    gate_up projection output [T, 2 I] of each MLP width (contiguous; the token count is only the grid), and for
    fp8-weight engines whose down_proj reaches torch._scaled_mm (plugins/fp8_linear.py
    scaled_mm_reachable) its fp8-output form."""
    from .fp8_linear import scaled_mm_reachable

    m = space.model
    # every MLP width: the dense MLP's, and an MoE model's shared expert's (runtime/models/qwen3_next.py)
    widths = {m.intermediate_size} | ({m.moe.shared_intermediate_size} if m.moe is not None else set())
    for width in sorted(widths):
        gate_up = space.fake(1, 2 * width, dtype=space.act_dtype)
        gated_act(gate_up, m.hidden_act)
        if scaled_mm_reachable(space, "down_proj"):
            gated_act(gate_up, m.hidden_act, quantize=True)
