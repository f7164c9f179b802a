"""The CUDA-graph path without CUDA: a DecodeGraphs whose replay, instead of replaying a graph,
runs it eagerly (DecodeGraphs.run_eagerly: the staged step in the static buffers, the model on
the context the graph would capture, its backends' graph_meta over those buffers). Tokens of such
a run equal an eager run's exactly when staging (load, graph_fill, padding) and the graphs'
metadata are right."""

from __future__ import annotations

import torch

from infhip.runtime.cuda_graphs import GraphKey


def simulate_graphs(llm, monkeypatch, sizes=(1, 2, 4)) -> tuple[list[GraphKey], set[GraphKey]]:
    """Give llm's runner such a DecodeGraphs; returns (the keys replayed, live list; the planned keys)."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)  # CPU: no pinned memory
    graphs = llm.runner.make_graphs(list(sizes))
    keys: list[GraphKey] = []

    def replay(step, bs, n, input_ids=None, key=GraphKey()):
        keys.append(key)
        graphs.graphs.setdefault((bs, key), None)  # "captured" on first use, as a real replay: debug_view lists it
        return graphs.run_eagerly(step, bs, n, input_ids, key)

    graphs.replay = replay
    llm.runner.graphs = graphs
    return keys, set(graphs.planned_keys())
