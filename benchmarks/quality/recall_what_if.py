"""Attention recall of InfiniteHiP masks under what-if pruning stages (CPU, a real model's keys).

    python -m benchmarks.quality.recall_what_if --engine engines/gemma-3-270m-3k --length 16384 \
        --layers 5,11,17 --stages "64,256,32768;64,32,8192;64,8,4096" --kv-cache-memory-bytes 6GiB
    python -m benchmarks.quality.recall_what_if --engine engines/smollm2-135m-3k --length 8000 \
        --layers all --special 0,1,2 --q-head-normalised

Runs `infhip-eval recall`'s measurement (`run_recall` with explicit per-layer params: prefill
dense, masks of the last --chunk queries, RoPE style none) for stages that no preset has, and
optionally the *q-head-normalised* experiment: each query head's sigma over every candidate is
shifted by that head's best before the max over the heads of a kv head. Only the float64
reference can do that (it scores every key; SelectRep sees representatives only), so it
measures the headroom of the idea, not a setting. Prints the mean recall and the worst layer's.
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

import infhip.plugins.infinitehip.pruning_ref as pruning_ref
from infhip.eval.recall import RecallConfig, run_recall
from infhip.plugins.infinitehip.rope_styles import NONE


def sigma_tables_q_head_normalised(q_rows, q_pos, keys, toks, chunk_of, num_chunks, n_stream, style, inv_freq):
    """pruning_ref._sigma_tables (style none) with every query head's table shifted by its best."""
    assert style == NONE, "the experiment covers RoPE style none (inside the trained window)"
    Hq, Hkv = q_rows.shape[1], keys.shape[1]
    k = keys.double().repeat_interleave(Hq // Hkv, dim=1)
    s = torch.einsum("thd,nhd->htn", q_rows.double(), k)
    s = s.masked_fill(toks[None, None, :] > q_pos[None, :, None], -math.inf).amax(dim=1)  # [Hq, n]
    best = s.amax(dim=1, keepdim=True)
    s = torch.where(best > -math.inf, s - best, s)
    table = s.view(Hkv, Hq // Hkv, -1).amax(dim=1)
    return [table, table]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--length", type=int, required=True)
    ap.add_argument("--layers", required=True, help="comma-separated layer indices, or all")
    ap.add_argument("--stages", default="64,256,32768;64,32,8192;64,8,2048", help="b_q,l_c,k;... (3k)")
    ap.add_argument("--special", default="", help="layers keeping 4096 in the last stage (3k: 0,1,2)")
    ap.add_argument("--n-sink", type=int, default=256)
    ap.add_argument("--n-stream", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--kv-cache-memory-bytes", default=None, help="KV budget, e.g. 6GiB")
    ap.add_argument("--q-head-normalised", action="store_true")
    args = ap.parse_args()

    stages = [[int(v) for v in s.split(",")] for s in args.stages.split(";")]
    special = {int(x) for x in args.special.split(",") if x}
    if args.q_head_normalised:
        pruning_ref._sigma_tables = sigma_tables_q_head_normalised
    kw = {"max_num_seqs": 1}
    if args.kv_cache_memory_bytes:
        from infhip.runtime.options import parse_size
        kw["kv_cache_memory_bytes"] = parse_size(args.kv_cache_memory_bytes)
    if args.layers == "all":
        from infhip.eval.common import load_llm
        layers = range(len(load_llm(args.engine, **kw).runner.model.layers))
    else:
        layers = [int(x) for x in args.layers.split(",")]
    params = {i: {"n_sink": args.n_sink, "n_stream": args.n_stream, "rope_style": "none",
                  "stages": stages[:-1] + [stages[-1][:2] + [4096]] if i in special else stages}
              for i in layers}
    result = run_recall([args.engine], RecallConfig(lengths=[args.length], chunk=args.chunk), params=params,
                        log=lambda *a: None, **kw)
    by_layer: dict[int, list[float]] = {}
    for r in result.records:
        by_layer.setdefault(r.layer, []).append(r.score)
    worst = min(by_layer, key=lambda layer: statistics.mean(by_layer[layer]))
    print(f"{args.engine} {args.length}: stages {args.stages}, q-head-normalised {args.q_head_normalised}: "
          f"mean recall {statistics.mean(r.score for r in result.records):.4f}, "
          f"worst layer {worst} {statistics.mean(by_layer[worst]):.3f}")


if __name__ == "__main__":
    main()
