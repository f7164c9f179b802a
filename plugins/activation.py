"""Gated MLP activation: act(gate) * up on a fused gate_up projection.

gate_up is [T, 2*I] with gate = gate_up[:, :I], up = gate_up[:, I:]; the output
is [T, I] in gate_up.dtype, computed in float32.

    silu(g)      = g * sigmoid(g)
    gelu_tanh(g) = 0.5 * g * (1 + tanh(sqrt(2/pi) * (g + 0.044715 g^3)))
                 = g * sigmoid(2 * sqrt(2/pi) * (g + 0.044715 g^3))

The sigmoid form of gelu_tanh avoids tanh, which Triton only exposes through
backend-specific libdevice calls; sigmoid is evaluated from exp(-|z|) so it never
overflows and saturates cleanly to 0 or 1 for large |z|.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._triton_utils import next_pow2, use_triton

_KINDS = {"silu": 0, "gelu_tanh": 1}


@triton.jit
def _gated_act_kernel(
    # inputs
    gate_up_ptr,  # [T, 2*I], last dim contiguous
    # outputs
    out_ptr,  # [T, I] contiguous
    # constants
    stride_in,  # row stride of gate_up
    I,
    BLOCK: tl.constexpr,
    KIND: tl.constexpr,  # 0 = silu, 1 = gelu_tanh
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    row = gate_up_ptr + t.to(tl.int64) * stride_in
    g_raw = tl.load(row + cols, mask=mask, other=0.0)
    g = g_raw.to(tl.float32)
    u = tl.load(row + I + cols, mask=mask, other=0.0).to(tl.float32)
    if KIND == 0:
        z = g
    else:
        z = 1.5957691216057308 * (g + 0.044715 * g * g * g)  # 2 * sqrt(2/pi) * (...)
    e = tl.exp(-tl.abs(z))  # in (0, 1]: no overflow for large |z|
    act = g * tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))  # g * sigmoid(z)
    tl.store(out_ptr + t.to(tl.int64) * I + cols, (act * u).to(g_raw.dtype), mask=mask)


def gated_act_triton(gate_up: torch.Tensor, kind: str) -> torch.Tensor:
    """Triton launcher; same contract as `gated_act`."""
    assert kind in _KINDS, f"unknown activation {kind!r}"
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, "gate_up must be [T, 2*I]"
    assert gate_up.stride(1) == 1, "gate_up: last dim must be contiguous"
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((T, I), dtype=gate_up.dtype, device=gate_up.device)
    if T > 0:
        BLOCK = min(next_pow2(I), 1024)
        grid = (T, triton.cdiv(I, BLOCK))
        _gated_act_kernel[grid](gate_up, out, gate_up.stride(0), I,
                                BLOCK=BLOCK, KIND=_KINDS[kind], num_warps=4)
    return out


def gated_act_ref(gate_up: torch.Tensor, kind: str) -> torch.Tensor:
    """Plain-torch reference (float32 math)."""
    I = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :I].float(), gate_up[..., I:].float()
    if kind == "silu":
        act = F.silu(gate)
    elif kind == "gelu_tanh":
        act = F.gelu(gate, approximate="tanh")
    else:
        raise ValueError(f"unknown activation {kind!r}")
    return (act * up).to(gate_up.dtype)


def gated_act(gate_up: torch.Tensor, kind: str) -> torch.Tensor:
    """act(gate_up[:, :I]) * gate_up[:, I:], kind in {"silu", "gelu_tanh"}."""
    if use_triton(gate_up):
        return gated_act_triton(gate_up, kind)
    return gated_act_ref(gate_up, kind)



def aot_launches(space) -> None:
    """The one launch the runtime makes (plugins/aot.py): the MLP's act(gate) * up on the fused
    gate_up projection output [T, 2 I] (contiguous; the token count is only the grid)."""
    m = space.model
    gated_act(space.fake(1, 2 * m.intermediate_size, dtype=space.act_dtype), m.hidden_act)
