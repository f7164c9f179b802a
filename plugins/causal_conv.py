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
