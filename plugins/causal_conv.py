"""The short causal depthwise convolution of a gated DeltaNet layer (Qwen3-Next: K = 4 taps over
the [q | k | v] channels), with its per-sequence state: the last K - 1 inputs. Plain-torch
references (prefill: one sequence's chunk; decode: one token of each of B sequences).

For channel c and input x (the state's K - 1 columns, then the chunk's T):

    full = [state | x]                           [C, K - 1 + T]
    y[c, t] = silu(sum_i w[c, i] * full[c, t + i])   t < T
    state  <- full[:, T:]                        (the last K - 1 inputs)

computed in the weight's dtype, as transformers' causal_conv1d_fn / causal_conv1d_update do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._triton_utils import next_pow2, use_triton


def conv_prefill(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """x [T, C] (one sequence's rows), weight [C, K], state [C, K - 1] (updated in place)
    -> silu(conv) [T, C] in x's dtype."""
    t, c = x.shape
    full = torch.cat([state.to(weight.dtype), x.t().to(weight.dtype)], dim=1)  # [C, K - 1 + T]
    state.copy_(full[:, t:])
    y = F.conv1d(full[None], weight[:, None, :], groups=c)[0]  # [C, T]
    return F.silu(y).t().to(x.dtype)


def conv_decode(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """x [B, C] (one row per sequence), weight [C, K], states [B, C, K - 1] (updated in place)
    -> [B, C]. Device ops only (graph-capturable)."""
    full = torch.cat([states.to(weight.dtype), x[:, :, None].to(weight.dtype)], dim=2)  # [B, C, K]
    states.copy_(full[:, :, 1:])
    return F.silu((full * weight[None]).sum(-1)).to(x.dtype)


def conv_ref(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, cu: list[int], slots: torch.Tensor,
             slots_list: list[int] | None, num_decodes: int) -> torch.Tensor:
    """The step's packed rows x [T, C] (decodes first) through the references, each sequence
    from and back to its slot of states [S, C, K - 1]; cu [B + 1] row ranges, slots [B] (and
    its host copy, None when every row decodes)."""
    out = torch.empty_like(x)
    if num_decodes:
        idx = slots[:num_decodes]
        st = states[idx]
        out[:num_decodes] = conv_decode(x[:num_decodes], weight, st)
        states.index_copy_(0, idx, st)
    for i in range(num_decodes, slots.shape[0]):
        out[cu[i]:cu[i + 1]] = conv_prefill(x[cu[i]:cu[i + 1]], weight, states[slots_list[i]])
    return out


@triton.jit
def _conv_kernel(x_ptr, w_ptr, out_ptr, state_ptr, cu_ptr, slot_ptr, sx_t, so_t, s_slot, C,
                 K: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr):
    """One (sequence, block of BC channels): each row t of cu[b]..cu[b+1] reads its K taps
    (inputs t - K + 1 .. t; those before the chunk from the slot's state), then the slot gets the
    last K - 1 inputs, read before anything is written."""
    b, cb = tl.program_id(0), tl.program_id(1)
    lo, hi = tl.load(cu_ptr + b).to(tl.int64), tl.load(cu_ptr + b + 1).to(tl.int64)  # 64-bit row offsets
    slot = tl.load(slot_ptr + b).to(tl.int64)
    cs = cb * BC + tl.arange(0, BC)
    taps = tl.arange(0, KP)
    cm = cs < C
    w = tl.load(w_ptr + cs[:, None] * K + taps[None, :], mask=cm[:, None] & (taps[None, :] < K), other=0.0)
    st = state_ptr + slot * s_slot + cs[:, None] * (K - 1)
    # the new state: inputs hi - K + 1 .. hi - 1, from x where inside the chunk, else the old state
    p = hi - (K - 1) + taps[None, :]
    keep = cm[:, None] & (taps[None, :] < K - 1)
    new = tl.where(p >= lo, tl.load(x_ptr + p * sx_t + cs[:, None], mask=keep & (p >= lo), other=0.0),
                   tl.load(st + (p - lo + K - 1), mask=keep & (p < lo), other=0.0))
    for t in range(lo, hi):
        p = t - (K - 1) + taps[None, :]
        m = cm[:, None] & (taps[None, :] < K)
        xin = tl.where(p >= lo, tl.load(x_ptr + p * sx_t + cs[:, None], mask=m & (p >= lo), other=0.0),
                       tl.load(st + (p - lo + K - 1), mask=m & (p < lo), other=0.0))
        y = tl.sum(xin.to(tl.float32) * w.to(tl.float32), 1)
        y = y / (1.0 + tl.exp(-y))
        tl.store(out_ptr + t * so_t + cs, y.to(out_ptr.dtype.element_ty), mask=cm)
    tl.store(st + taps[None, :], new, mask=keep)


def conv_triton(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, cu: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
    """Triton launcher (one launch per step, no host sync); conv_ref's contract with cu [B + 1]
    int32 and slots [B] int64 on the device; x [T, C] may be a strided view (rows contiguous).
    Math in float32 (the references: the weight's dtype; equal for float32 engines)."""
    t, c = x.shape
    k = weight.shape[1]
    assert x.stride(1) == 1 and weight.is_contiguous() and states.is_contiguous() and states.shape[1:] == (c, k - 1)
    out = torch.empty(t, c, dtype=x.dtype, device=x.device)
    bc = min(next_pow2(c), 128)
    _conv_kernel[(slots.shape[0], triton.cdiv(c, bc))](x, weight, out, states, cu, slots, x.stride(0), out.stride(0),
                                                       states.stride(0), c, K=k, KP=next_pow2(k), BC=bc)
    return out


def causal_conv(x, weight, states, cu: torch.Tensor, slots: torch.Tensor, cu_list: list[int],
                slots_list: list[int] | None, num_decodes: int) -> torch.Tensor:
    """silu(causal conv) of a step's packed rows, each sequence from and back to its state slot:
    the Triton kernel on the GPU (the tests run it on the CPU under TRITON_INTERPRET=1), else
    the torch references."""
    if use_triton(x):
        return conv_triton(x, weight, states, cu, slots)
    return conv_ref(x, weight, states, cu_list, slots, slots_list, num_decodes)


def aot_launches(space) -> None:
    """A linear-attention layer's one conv launch per step (runtime/models/qwen3_next.py): x the
    [q k v] columns of the in_proj output [T, conv_dim + value_dim + 2 Hv] (a strided view)."""
    la = space.model.linear_attention
    if la is None:
        return
    proj = space.fake(1, la.conv_dim + la.value_dim + 2 * la.num_value_heads, dtype=space.act_dtype)
    weight = space.fake(la.conv_dim, la.conv_kernel, dtype=space.act_dtype)
    states = space.fake(2, la.conv_dim, la.conv_kernel - 1, dtype=space.act_dtype)
    conv_triton(proj[:, :la.conv_dim], weight, states, space.fake(2, dtype=torch.int32), space.fake(1, dtype=torch.int64))
