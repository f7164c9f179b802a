"""One 32K prefill chunk's InfiniteHiP kernels at N keys, launched twice (compile, then the run
to profile), for Nsight Compute: where each stage's and the attention's time goes (DRAM / L2
bytes, SM and tensor-pipe throughput, occupancy), Llama-3.1-8B shapes, the runtime's defaults.

    ncu --clock-control none -k regex:"_select_rep_kernel|_sparse_attn_kernel" --launch-skip 4 \
        --launch-count 4 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
        python3 -m benchmarks.speed.profile_prefill --context 1m

The first four matching launches (stages 1-3 and the attention) compile and warm; the next four
are the profiled ones. Each pass prints the event time of each part (one launch each, the
defaults; bench_infinitehip.py gives the medians).
"""

from __future__ import annotations

import argparse

import torch
from benchmarks.speed.one_layer import CHUNK, SCALE, PagedContext, parse_len, styles

from infhip.methods.infinitehip import infinitehip_config
from infhip.plugins.infinitehip import plan_query_blocks, pruning_stage, sparse_prefill_attention, unrotate_keys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", default="1m")
    ap.add_argument("--preset", default="3k")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    ctx = PagedContext(parse_len(args.context), gen)
    cfg = infinitehip_config(args.preset)
    q = torch.randn(CHUNK, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    starts, lens, ends, seq = plan_query_blocks([CHUNK], [ctx.n], cfg.block_q, device="cuda")
    tables = ctx.table.expand(starts.shape[0], -1).contiguous()
    middle = max(0, ctx.n - cfg.n_stream - cfg.n_sink)
    prune_rope, attn_rope = styles(ctx.n, cfg)
    kw = dict(n_sink=cfg.n_sink, n_stream=cfg.n_stream, inv_freq=ctx.inv_freq)
    raw = unrotate_keys(ctx.paged, ctx.table, [ctx.n], ctx.inv_freq, seq.long()) if prune_rope != "none" else None
    out = torch.empty_like(q)

    def timed(times: dict, name: str, fn):
        """fn() once, its event time in times[name]; returns fn's result."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        times[name] = round(start.elapsed_time(end), 2)
        return result

    for attempt in ("warm", "profiled"):  # under ncu: one launch of each kernel per pass
        times, prev = {}, (None, None)
        for i, st in enumerate(cfg.stages):
            prev = timed(times, f"stage{i + 1}", lambda: pruning_stage(
                q, ctx.paged, tables, starts, lens, ends, *prev, chunk_size=st.chunk_size, k=st.k,
                block_q=cfg.block_q, max_candidates=middle if i == 0 else None, rope_style=prune_rope,
                query_stride=cfg.query_strides[i], raw_keys=raw, **kw))
        timed(times, "attention", lambda: sparse_prefill_attention(
            q, ctx.paged, tables, starts, lens, ends, prev[0], block_q=cfg.block_q, scale=SCALE,
            rope_style=attn_rope, rope_group=cfg.stages[-1].chunk_size, out=out, **kw))
        print(attempt, times, flush=True)


if __name__ == "__main__":
    main()
