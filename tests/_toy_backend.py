"""A toy third attention backend, "sink_window": each query attends to the first ``sink`` tokens
of its sequence and its last ``window`` tokens only (StreamingLLM's pattern), in torch.

It is the example of docs/design/adding.md's "adding an attention backend": this file, its plan
method (tests/_toy_method.py: knobs, preset) and :func:`register_toy` are all it takes
(tests/test_attention_backend_registry.py). The layers it runs and its knobs come from the
engine's plan (the base class's ``knobs_of`` / ``layers_of``). Its run is device-only (no host
list, no sync), so a CUDA graph captures it; its graph key is a constant (every pure decode step
replays).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from infhip import methods
from infhip.runtime import attention
from infhip.runtime.attention import DENSE, AttentionBackend
from infhip.runtime.forward_context import upload
from tests._toy_method import SinkWindow, SinkWindowKnobs


@dataclass
class SinkWindowHost:
    seq_of_row: list[int]  # sequence (batch index) of each query row of the step


@dataclass
class SinkWindowMeta:
    seq_of_row: torch.Tensor  # int64 [T]


def sink_window_attention(q: torch.Tensor, kv, tables: torch.Tensor, seq_of_row: torch.Tensor,
                          positions: torch.Tensor, sink: int, window: int, scale: float) -> torch.Tensor:
    """q [T, Hq, D] (rotated) over the paged cache kv: row t (of sequence seq_of_row[t], at
    positions[t]) attends to keys j <= positions[t] with j < sink or j > positions[t] - window.
    Launches only: fixed shapes [T, sink + window], no host sync."""
    T, Hq, D = q.shape
    ps, Hkv = kv.k.shape[1], kv.k.shape[2]
    dev = q.device
    pos = positions[:, None]
    idx = torch.cat([torch.arange(sink, device=dev).expand(T, sink),
                     pos - window + 1 + torch.arange(window, device=dev)], 1)  # [T, S + W] key positions
    valid = (idx >= 0) & (idx <= pos)
    valid[:, sink:] &= idx[:, sink:] >= sink  # a sink key inside the window counts once
    safe = idx.clamp(min=0)
    slots = tables.long()[seq_of_row[:, None], safe // ps] * ps + safe % ps  # [T, S + W]
    keys = kv.k.reshape(-1, Hkv, D)[slots].float().repeat_interleave(Hq // Hkv, dim=2)  # [T, S + W, Hq, D]
    vals = kv.v.reshape(-1, Hkv, D)[slots].float().repeat_interleave(Hq // Hkv, dim=2)
    scores = torch.einsum("thd,tkhd->thk", q.float(), keys) * scale
    probs = torch.softmax(scores.masked_fill(~valid[:, None, :], -math.inf), dim=-1)
    return torch.einsum("thk,tkhd->thd", probs, vals).to(q.dtype)


class SinkWindowBackend(AttentionBackend):
    name = "sink_window"  # its plan method: tests/_toy_method.py (torch only: no kernel to compile)

    def __init__(self, knobs: SinkWindowKnobs, device: torch.device):
        self.knobs, self.device = knobs, device

    @classmethod
    def attach(cls, config, knobs: SinkWindowKnobs, layers: list, env) -> "SinkWindowBackend":
        backend = cls(knobs, env.device)
        claimed = set(cls.layers_of(config))
        for attn in layers:
            if attn.layer_index in claimed:
                assert attn.window is None and attn.kv.k_scale is None, "global, unscaled layers only"
                attn.backend = backend
        return backend

    def debug_view(self) -> dict:
        return {"sink": self.knobs.sink, "window": self.knobs.window}

    def plan(self, step, seqs: list) -> SinkWindowHost:
        return SinkWindowHost([b for b in range(len(step.ctx_lens)) for _ in range(step.cu[b + 1] - step.cu[b])])

    def upload(self, host: SinkWindowHost, step) -> SinkWindowMeta:
        return self._meta(upload(host.seq_of_row, torch.int64, self.device))

    @staticmethod
    def _meta(seq_of_row: torch.Tensor) -> SinkWindowMeta:  # eager steps and graphs alike
        return SinkWindowMeta(seq_of_row)

    def run(self, layer, q, k, v, ctx, meta: SinkWindowMeta) -> torch.Tensor:
        paging = ctx.groups[layer.kv_group]
        DENSE.rope_and_write(layer, q, k, v, ctx.positions, paging.slot_mapping)
        return sink_window_attention(q, layer.kv, paging.block_tables, meta.seq_of_row, ctx.positions,
                                     self.knobs.sink, self.knobs.window, layer.scale)

    # every pure decode step replays one graph per batch size; row b is sequence b
    def graph_key(self, host) -> str:
        return "all"

    def graph_keys(self, layer_kv: bool = False) -> list[str]:
        return [] if layer_kv else ["all"]

    def graph_state(self, max_bs: int, rows: torch.Tensor) -> torch.Tensor:
        return torch.arange(max_bs, dtype=torch.int64, device=rows.device)

    def graph_meta(self, key, bs: int, state: torch.Tensor, common) -> SinkWindowMeta:
        return self._meta(state[:bs])


def register_toy() -> None:
    """Register the toy's plan method and its attention backend (the two registrations it takes)."""
    methods.register(SinkWindow)
    attention.register(SinkWindowBackend)


def unregister_toy() -> None:
    attention.unregister(SinkWindowBackend.name)
    methods.unregister(SinkWindow.name)
