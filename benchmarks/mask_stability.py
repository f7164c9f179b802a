"""How much of a decode step's pruning mask survives into a later step, on a real model and real
text: the hit ratio an LRU of GPU page copies (runtime/offload_cache.py) could reach.

The last ``--queries`` positions of a KJV window are teacher-forced decode steps: after prefilling
the window, each of their (rotated) queries runs the stage chain alone (a query block of one, as
decode does, keys up to its own position). For each stage, the pages (16 tokens) its survivors
lie on at step t are compared with those at step t + lag:

    kept(lag) = |pages(t) & pages(t + lag)| / |pages(t + lag)|       mean over t, layers

= the share of step t + lag's pages that a cache filled at step t would hold. Random weights give
about k / middle (the masks are independent); the offload cache needs it near 1.

    python benchmarks/mask_stability.py --engine engines/smollm2-135m-3k --length 8192 \\
        --stages "1,64,1024;1,16,512;1,4,256" --lags 4,16

CPU, float32 (references). Prints a table per stage; --json writes the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def stage_pages(attn, q: torch.Tensor, table: list[int], length: int, stages, n_sink: int, n_stream: int,
                rope_style: str) -> list[list[set[int]]]:
    """Per stage, per query (q [C, Hq, D]: the last C positions of a `length`-token sequence), the
    set of pages its survivors lie on."""
    from infhip.plugins.infinitehip import PAD, plan_query_blocks, pruning_stage

    C, dev = q.shape[0], q.device
    q_start, q_lens, ends, _ = plan_query_blocks([C], [length], 1, device=dev)  # one query per block
    tables = torch.tensor([table], dtype=torch.int32, device=dev).expand(len(ends), -1).contiguous()
    inv_freq = attn.rope[0].inv_freq if rope_style != "none" else None
    page = attn.k_cache.shape[1]
    out, sel, num = [], None, None
    for b_q, l_c, k in stages:
        sel, num = pruning_stage(q, attn.k_cache, tables, q_start, q_lens, ends, sel, num, chunk_size=l_c, k=k,
                                 block_q=1, n_sink=n_sink, n_stream=n_stream, rope_style=rope_style,
                                 inv_freq=inv_freq, k_scale=attn.k_scale)
        out.append([{int(t) // page for t in row[:n].tolist() if t != PAD} for row, n in zip(sel, num.tolist())])
    return out


def kept_fraction(pages: list[set[int]], lag: int) -> float:
    vals = [len(pages[t] & pages[t + lag]) / len(pages[t + lag]) for t in range(len(pages) - lag) if pages[t + lag]]
    return sum(vals) / len(vals) if vals else float("nan")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", required=True)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--queries", type=int, default=64)
    p.add_argument("--stages", default=None, help='"b,l_c,k;..." (default: the engine plan\'s)')
    p.add_argument("--lags", default="4,16")
    p.add_argument("--sample", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    from infhip.eval.common import load_llm
    from infhip.eval.forcing import teacher_force
    from infhip.eval.ppl import ppl_items
    from infhip.eval.recall import capture_queries

    llm = load_llm(args.engine, None, infinitehip_overrides={"dense_threshold": 1 << 30})  # dense prefill
    ih = llm.engine.config.plan.infinitehip
    if ih is None:
        sys.exit("the engine has no InfiniteHiP plan: build it with --preset 3k")
    stages = ([tuple(int(x) for x in s.split(",")) for s in args.stages.split(";")] if args.stages
              else [(1, s.chunk_size, s.k) for s in ih.stages])
    lags = [int(x) for x in args.lags.split(",")]
    items = ppl_items(llm.tokenizer, args.length, 1, args.sample + 1, 0)
    ctx, tgt = items[args.sample]
    ids = ctx + tgt
    layers = [lp.index for lp in llm.engine.config.plan.layers if lp.plugin == "infinitehip"]
    per_stage = [[[] for _ in lags] for _ in stages]  # [stage][lag] -> per-layer values
    with capture_queries(llm.runner.model, layers, args.queries) as store:
        gen = teacher_force(llm, [(ids, [0])])
        next(gen)
        seq = next(s for s in llm.scheduler.running)
        for i in layers:
            attn = llm.runner.model.layers[i].self_attn
            q = torch.cat(store[i])[-args.queries:]
            table = llm.runner.kv.block_table(seq.seq_id, attn.kv_group)
            rope = ih.pruning_rope_of(i) if len(ids) > llm.engine.config.model.max_position_embeddings else "none"
            pages = stage_pages(attn, q, table, len(ids), stages, ih.n_sink, ih.n_stream, rope)
            for s, ps in enumerate(pages):
                for j, lag in enumerate(lags):
                    per_stage[s][j].append(kept_fraction(ps, lag))
        gen.close()
    middle = len(ids) - ih.n_sink - ih.n_stream
    print(f"\n{args.engine}, {len(ids)} tokens (KJV sample {args.sample}), last {args.queries} positions as decode "
          f"steps, {len(layers)} layers; pages of {llm.runner.page_size} tokens")
    print(f"{'stage (b, l_c, k)':<22}{'k / middle':>11}" + "".join(f"{f'kept, lag {lag}':>15}" for lag in lags)
          + f"{'lowest layer':>14}")
    res = {"engine": args.engine, "length": len(ids), "queries": args.queries, "stages": stages, "lags": lags,
           "per_layer": {}}
    for s, st in enumerate(stages):
        means = [sum(v) / len(v) for v in per_stage[s]]
        print(f"{str(st):<22}{min(1.0, st[2] / middle):>11.3f}" + "".join(f"{m:>15.3f}" for m in means)
              + f"{min(per_stage[s][-1]):>14.3f}")
        res["per_layer"][str(st)] = {str(lag): per_stage[s][j] for j, lag in enumerate(lags)}
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
