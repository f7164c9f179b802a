"""Tensor-parallel engines: cut the converted weights into one file per rank (Megatron-style).

Input: the whole engine's tensors (our names, infhip/config.py), fp8 scales included; output:
rank r's tensors under the same names, shaped for infhip/tensor_parallel.py's shard r:

    qkv_proj.weight / .bias / .weight_scale  rows: the rank's q heads, then its kv heads' k, v
    o_proj.weight                            columns of its q heads        (scale: per output row, whole)
    gate_up_proj.weight / .weight_scale      rows: gate[lo:hi], then up[lo:hi]
    down_proj.weight                         columns [lo:hi]                (scale: whole)
    everything else                          replicated

Cutting after fp8 quantization is exact: a scale belongs to an output channel, and a
row-parallel layer keeps every output channel (its input columns are cut).
"""

from __future__ import annotations

import torch

from infhip.config import ModelConfig
from infhip.tensor_parallel import RankShard, shard_layout


def _rows(t: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """Rows [lo, hi) of each range, concatenated (float8 through a uint8 view: cat on bytes)."""
    fp8 = t.dtype.itemsize == 1 and t.dtype.is_floating_point
    src = t.view(torch.uint8) if fp8 else t
    out = torch.cat([src[lo:hi] for lo, hi in ranges]).contiguous()
    return out.view(t.dtype) if fp8 else out


def _cols(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return _rows(t.t(), [(lo, hi)]).t().contiguous() if t.dtype.itemsize == 1 else t[:, lo:hi].contiguous()


def _qkv_ranges(m: ModelConfig, s: RankShard) -> list[tuple[int, int]]:
    d, q_size, kv_size = m.head_dim, m.q_size, m.kv_size
    (q0, q1), (k0, k1) = s.q_heads, s.kv_heads
    return [(q0 * d, q1 * d), (q_size + k0 * d, q_size + k1 * d),
            (q_size + kv_size + k0 * d, q_size + kv_size + k1 * d)]


def shard_tensor(name: str, t: torch.Tensor, m: ModelConfig, s: RankShard) -> torch.Tensor:
    """Rank s's part of tensor `name` (the whole tensor when replicated)."""
    module, _, kind = name.rpartition(".")  # kind: weight | bias | weight_scale
    (i0, i1), inter = s.intermediate, m.intermediate_size
    if module.endswith("self_attn.qkv_proj"):
        return _rows(t, _qkv_ranges(m, s))
    if module.endswith("mlp.gate_up_proj"):
        return _rows(t, [(i0, i1), (inter + i0, inter + i1)])
    if kind == "weight" and module.endswith("self_attn.o_proj"):
        d = m.head_dim
        return _cols(t, s.q_heads[0] * d, s.q_heads[1] * d)
    if kind == "weight" and module.endswith("mlp.down_proj"):
        return _cols(t, i0, i1)
    return t


def shard_weights(tensors: dict[str, torch.Tensor], m: ModelConfig, tp: int) -> list[dict[str, torch.Tensor]]:
    """[rank r's tensors for r in range(tp)] (replicated tensors are shared, not copied)."""
    return [{name: shard_tensor(name, t, m, s) for name, t in tensors.items()} for s in shard_layout(m, tp)]
