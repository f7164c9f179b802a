"""Attention recall of an engine's sparse layers: per layer and query head, the fraction of the
dense attention probability mass that the engine's InfiniteHiP key sets keep (paper 000 Fig. 6a),
measured with the plugins' helper `attention_recall`.

How: prefill a KJV window through the engine; during the prefill capture, at every sparse layer,
the rotated queries of the last `chunk` tokens (wrapping `rope_and_write_kv`, which rotates q in
place); keep the sequence's pages alive and read its rotated keys from the layer's paged cache;
run the layer's pruning stages (`pruning_stage`: Triton on GPU, float64 reference on CPU) on
those queries over that cache, turn the survivors into per-query key masks (`per_query_key_mask`)
and score them against exact dense attention.

The sparse parameters come from the plan's InfiniteHiP knobs (`plan.knobs_of("infinitehip")`: n_sink,
n_stream, the layer's stages and pruning RoPE style), resolved into {"n_sink", "n_stream",
"stages": [[b_q, l_c, k], ...], "rope_style"} per layer. A dense plan raises `NoSparseLayers`
(CLI exit 3); tests also drive the path on dense engines by passing `params` explicitly.

    >>> from infhip.eval.recall import RecallConfig, run_recall                     # doctest: +SKIP
    >>> run_recall(["engines/x-3k"], RecallConfig(lengths=[8192])).markdown()      # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from infhip.eval.common import EvalError, check_fits, engine_info, engine_name, load_llm
from infhip.eval.forcing import teacher_force
from infhip.eval.ppl import ppl_items
from infhip.eval.results import EvalResult, Record
from infhip.plugins.kv_quant import read_rows


class NoSparseLayers(RuntimeError):
    """The engine's plan runs every layer dense: there is no sparse mask to measure."""


@dataclass
class RecallConfig:
    lengths: list[int] = field(default_factory=lambda: [8192])
    chunk: int = 64  # measured queries: the last `chunk` tokens of each window
    samples: int = 1
    seed: int = 0
    text: str = "kjv"  # the windows' source (infhip.eval.text.SOURCES: kjv, pg, ...)


def sparse_layer_params(llm, length: int | None = None) -> dict[int, dict[str, Any]]:
    """{layer index: pruning params} of the plan's non-dense layers; NoSparseLayers if none.

    Params come from `plan.knobs_of("infinitehip")` (an InfiniteHipConfig: `stages_of(layer)`,
    `pruning_rope_of(layer)`; RoPE off inside the trained window when `rope_off_in_trained_window`
    and `length` fits it), else from a per-layer `params` dict, the format `layer_recall` takes."""
    plan = llm.engine.config.plan
    layers = [lp for lp in plan.layers if lp.backend != "dense"]
    if not layers:
        raise NoSparseLayers(
            f"engine plan (preset {plan.preset!r}) has no sparse layers: every layer's backend is 'dense', "
            "so there is no sparse mask whose recall could be measured. Build the engine with an "
            "InfiniteHiP preset (e.g. --preset 3k).")
    ih = plan.knobs_of("infinitehip")
    if ih is None:
        return {lp.index: dict(getattr(lp, "params", None) or {}) for lp in layers}
    trained = llm.engine.config.model.max_position_embeddings
    rope_off = ih.rope_off_in_trained_window and length is not None and length <= trained
    return {lp.index: {"n_sink": ih.n_sink, "n_stream": ih.n_stream,
                       "stages": [[st.block_q, st.chunk_size, st.k] for st in ih.stages_of(lp.index)],
                       "query_strides": list(ih.query_strides),
                       "rope_style": "none" if rope_off else ih.pruning_rope_of(lp.index),
                       "head_normalized": ih.chunk_score == "head_normalized",
                       "dense_threshold": ih.dense_threshold} for lp in layers}


@contextlib.contextmanager
def capture_queries(model, layers: list[int], num_queries: int):
    """Collect, per listed layer, the rotated queries of the last `num_queries` rows of every step
    (the last step of a prefill holds the tail). Yields {layer: list of [T, Hq, D] tensors}."""
    from infhip.runtime.attention import dense

    store: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    current: list[int | None] = [None]
    original = dense.rope_and_write_kv  # every backend rotates through DenseBackend.rope_and_write

    def wrapped(q, k, v, *args, **kwargs):
        original(q, k, v, *args, **kwargs)
        if current[0] in store:  # q was rotated in place
            store[current[0]].append(q[-num_queries:].detach().clone())

    hooks = [model.layers[i].self_attn.register_forward_pre_hook(
        lambda mod, inp, i=i: current.__setitem__(0, i)) for i in range(len(model.layers))]
    dense.rope_and_write_kv = wrapped
    try:
        yield store
    finally:
        dense.rope_and_write_kv = original
        for h in hooks:
            h.remove()


def layer_recall(attn, q: torch.Tensor, table: list[int], length: int, params: dict[str, Any]) -> torch.Tensor:
    """float64 [Hq] recall of one layer: q [C, Hq, D] the newest C queries of a `length`-token
    sequence whose keys sit in attn.kv.k at page-table row `table`."""
    from infhip.plugins.infinitehip import (attention_recall, per_query_key_mask, plan_query_blocks,
                                            pruning_stage)

    n_sink, n_stream, stages = params["n_sink"], params["n_stream"], params["stages"]
    rope_style = params.get("rope_style", "none")
    C, dev = q.shape[0], q.device
    block_q = stages[0][0]
    q_start, q_lens, ends, _ = plan_query_blocks([C], [length], block_q, device=dev)
    tables = torch.tensor([table], dtype=torch.int32, device=dev).expand(len(ends), -1).contiguous()
    inv_freq = attn.rope[0].inv_freq if rope_style != "none" else None
    strides = params.get("query_strides") or [1] * len(stages)
    sel = num = None
    for (b_q, l_c, k), stride in zip(stages, strides):
        # the table lists GPU pages only: the host twin (if any) is not read
        sel, num = pruning_stage(q, attn.kv.with_host(None), tables, q_start, q_lens, ends, sel, num, chunk_size=l_c,
                                 k=k, block_q=b_q, n_sink=n_sink, n_stream=n_stream, rope_style=rope_style,
                                 inv_freq=inv_freq, head_normalized=params.get("head_normalized", False),
                                 query_stride=stride)
    keep = per_query_key_mask(sel, q_lens, ends, n_sink, n_stream, length)
    page = attn.kv.k.shape[1]
    rows = torch.tensor(table, device=dev).repeat_interleave(page)[:length]
    keys = read_rows(attn.kv.k, attn.kv.k_scale, rows, torch.arange(length, device=dev) % page, q.dtype)  # [length, Hkv, D]
    per_head, _ = attention_recall(q, keys, keep, scale=attn.scale)
    return per_head


def measure_recall(llm, ids: list[int], chunk: int, params: dict[int, dict[str, Any]]) -> dict[int, torch.Tensor]:
    """Prefill `ids`, then recall per head of every layer in `params`: {layer: float64 [Hq]}."""
    if chunk >= len(ids):
        raise EvalError(f"chunk ({chunk}) must be shorter than the window ({len(ids)})")
    layers = sorted(params)
    with capture_queries(llm.runner.model, layers, chunk) as store:
        # One forced target: the prefill of all ids runs, then we stop before any decode step.
        gen = teacher_force(llm, [(ids, [0])])
        next(gen)  # the prefill's last step has run; the sequence still holds its pages
        seq = next(s for s in llm.scheduler.running)
        out = {}
        for i in layers:
            attn = llm.runner.model.layers[i].self_attn
            if not store[i]:  # the runtime's attention no longer goes through dense.rope_and_write_kv
                raise RuntimeError(f"no queries captured at layer {i}: update recall.capture_queries to "
                                   "the runtime's attention module")
            q = torch.cat(store[i])[-chunk:]
            table = llm.runner.kv.block_table(seq.seq_id, attn.kv_group)
            out[i] = layer_recall(attn, q, table, len(ids), params[i])
        gen.close()  # frees the pages
    return out


def run_recall(engines: list[str], cfg: RecallConfig, device: str | None = None, log=print,
               params: dict[int, dict[str, Any]] | None = None, **llm_kwargs) -> EvalResult:
    """Recall per (engine, length, layer, head). `params` overrides the plan (tests, what-ifs)."""
    records, infos = [], {}
    for engine in engines:
        llm, name = load_llm(engine, device, **llm_kwargs), engine_name(engine)
        infos[name] = engine_info(llm)
        if params is None:
            sparse_layer_params(llm)  # NoSparseLayers before any work
        for length in cfg.lengths:
            check_fits(llm, length)
            layer_params = params if params is not None else sparse_layer_params(llm, length)
            # Below its dense_threshold the engine runs these layers dense (recall 1 in practice);
            # we still measure the masks it would use, and say so in each record.
            dense = any(length < p.get("dense_threshold", 0) for p in layer_params.values())
            if dense:
                log(f"recall {name} {length}: below the engine's dense_threshold, it runs dense there; "
                    "measuring the masks it would use above it")
            t0 = time.perf_counter()
            for s, (ctx, tgt) in enumerate(ppl_items(llm.tokenizer, length, 1, cfg.samples, cfg.seed, cfg.text)):
                for layer, per_head in measure_recall(llm, ctx + tgt, cfg.chunk, layer_params).items():
                    records += [Record("recall", name, length, float(r), metric="recall", sample=s,
                                       layer=layer, head=h, extra={"engine_runs_dense": dense})
                                for h, r in enumerate(per_head.tolist())]
            log(f"recall {name} {length}: {len(layer_params)} layers, {time.perf_counter() - t0:.1f} s")
    return EvalResult("recall", {"lengths": cfg.lengths, "chunk": cfg.chunk, "samples": cfg.samples,
                                 "seed": cfg.seed, "engines": engines, "engine_info": infos}, records)
