"""A toy attention backend with a Triton kernel and KV offload, "sink_window_triton": the proof that
such a backend is its own files plus its registration (docs/design/adding.md). Its plan method is
tests/_toy_triton_method.py, its kernel tests/_toy_triton_kernel.py; tests/test_toy_triton_backend.py
builds it into an engine, runs it under the interpreter, offloads its pages and puts it through
the compile matrix, with :func:`register` as the one registration.

Every step plans every row of its layers (no dense rows), so once a request's context reaches
``offload_from`` its pages may move to the host (``offload_window``: none kept on the GPU but the
page being written) and the kernel reads them there. Its run is device-only (a CUDA graph captures
it; graph key constant).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infhip import methods
from infhip.runtime import attention
from infhip.runtime.attention import DENSE, AttentionBackend
from infhip.runtime.forward_context import upload
from tests._toy_triton_kernel import sink_window_attention
from tests._toy_triton_method import SinkWindowTriton, SinkWindowTritonKnobs


@dataclass
class RowsMeta:
    seq_of_row: torch.Tensor  # int64 [T]: the sequence (batch index) of each query row


class SinkWindowTritonBackend(AttentionBackend):
    name = "sink_window_triton"
    offload_hint = "sink_window_triton: build it with --preset sink-window-triton"

    def __init__(self, knobs: SinkWindowTritonKnobs, device: torch.device):
        self.knobs, self.device = knobs, device

    @classmethod
    def offload_window(cls, config) -> tuple[int, int, int]:
        """(min_context, head, tail): every whole page of a request past ``offload_from`` may move."""
        return cls.knobs_of(config).offload_from, 0, 0

    @classmethod
    def attach(cls, config, knobs: SinkWindowTritonKnobs, layers: list, env) -> "SinkWindowTritonBackend":
        backend = cls(knobs, env.device)
        claimed = set(cls.layers_of(config))
        for attn in layers:
            if attn.layer_index in claimed:
                if attn.kv.k_scale is not None:
                    raise ValueError("sink_window_triton reads unscaled KV caches only: build with --kv-dtype "
                                     "matching --dtype")
                attn.backend = backend
        return backend

    def plan(self, step, seqs: list) -> list[int]:
        return [b for b in range(len(step.ctx_lens)) for _ in range(step.cu[b + 1] - step.cu[b])]

    def upload(self, host: list[int], step) -> RowsMeta:
        return RowsMeta(upload(host, torch.int64, self.device))

    def run(self, layer, q, k, v, ctx, meta: RowsMeta) -> torch.Tensor:
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

    def graph_meta(self, key, bs: int, state: torch.Tensor, common) -> RowsMeta:
        return RowsMeta(state[:bs])


def register() -> None:
    """Its registration: the plan method and the backend (an extension would import this module)."""
    methods.register(SinkWindowTriton)
    attention.register(SinkWindowTritonBackend)


def unregister() -> None:
    attention.unregister(SinkWindowTritonBackend.name)
    methods.unregister(SinkWindowTriton.name)
