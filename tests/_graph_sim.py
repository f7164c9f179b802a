"""The CUDA-graph path without CUDA: a DecodeGraphs whose replay, instead of replaying a graph,
copies the staged step into the static buffers and runs the model eagerly on the context the
graph would capture (its backends' graph_meta over those buffers). Tokens of such a run equal an
eager run's exactly when staging (load, graph_fill, padding) and the graphs' metadata are right."""

from __future__ import annotations

import torch

from infhip.runtime.cuda_graphs import GraphKey
from infhip.runtime.forward_context import forward_context


def simulate_graphs(llm, monkeypatch, sizes=(1, 2, 4)) -> tuple[list[GraphKey], set[GraphKey]]:
    """Give llm's runner such a DecodeGraphs; returns (the keys replayed, live list; the planned keys)."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)  # CPU: no pinned memory
    graphs = llm.runner.make_graphs(list(sizes))
    keys: list[GraphKey] = []

    def replay(step, bs, n, input_ids=None, key=GraphKey()):
        keys.append(key)
        graphs.graphs.setdefault((bs, key), None)  # "captured" on first use, as a real replay: debug_view lists it
        graphs.rows[:, :bs].copy_(graphs.steps[step, :, :bs])
        if input_ids is not None:
            graphs.input_ids[:n].copy_(input_ids)
        with forward_context(graphs._context(bs, key)):
            return graphs._forward(bs, key.kv_shift)[:n]

    graphs.replay = replay
    llm.runner.graphs = graphs
    return keys, set(graphs.planned_keys())
