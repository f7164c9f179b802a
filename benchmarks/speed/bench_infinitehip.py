"""InfiniteHiP plugins vs SDPA, one attention layer of Llama-3.1-8B (32 q / 8 kv heads, d = 128, bf16).

    python -m benchmarks.speed.bench_infinitehip --out $OUT [--contexts 128k,1m] [--presets 3k,3k-fast,3k-flash,5k]
        [--mask-layouts shared,kv_head,q_head]

Everything is measured in the same run on the same paged KV cache (page 16, pages in random
order, random bf16 keys/values):

* **SDPA baseline** (`torch.nn.functional.scaled_dot_product_attention`, default backend
  selection, the strongest per SPEC §7): decode = one query over all N keys (the faster of
  `enable_gqa=True` and K/V expanded to 32 heads); prefill of a 32K chunk at the end of N keys =
  the chunk against the N - 32K earlier keys (no mask) + the chunk against itself (causal), the
  sum of the two calls (a lower bound of dense work: the merge is not counted).
* **Decode, per step type**: a step recomputes pruning stages i..2 from the mask cache (i = 0:
  every stage, i = 3: none, the fully cached step) and then runs block-sparse decode attention
  over sink + final selection + stream. Each step type is captured in a CUDA graph of `--reps`
  copies and replayed (as the runtime's decode graphs would); time per step = replay / reps.
* **Amortized over the refresh cycle** of each preset: the mean of the step types weighted by
  how often each occurs in one cycle of n_refresh(0) steps (mask_cache.refresh_schedule).
* **Rotated key bank** (past the trained window): the same step types with the last stage's
  keys rotated into a bank when it refreshes and the attention reading them (key_bank.py),
  reported as "<preset> key bank".
* **Refresh spikes**: the attention time of a whole 32-layer decode step over the cycle, (a)
  with every layer refreshing at the same steps (the paper's schedule) and (b) with refresh
  phases staggered across layers (layer l shifted by l * n_refresh(0) / 32 steps): max and P99
  over median, composed from the measured per-layer step times.
* **Prefill of a 32K chunk**: all stages fresh for 512 query blocks of 64 + block-sparse
  prefill attention, with a per-stage breakdown (`triton.testing.do_bench`, median).

* **Mask layouts** (`--mask-layouts`, plugins/infinitehip/blocks.MASK_LAYOUTS): the same decode
  step types and the preset's prefill with one selection per kv head or per q head (each head its
  own k) instead of one shared by all heads; reported as "<preset> <layout>" with the time ratio
  to the shared layout of the same run. Per-head layouts run without the key bank (it holds one
  selection per block) and without the launch-variant sweeps.

RoPE follows the runtime's rule: inside the trained window (128K for Llama-3.1) keys keep their
cached rotation; beyond it pruning uses the relative style and attention the streaming style.
Normal layers are timed (the 3 special layers 1-3 keep 4096 in the last stage). Writes
`bench_infinitehip.json` to --out and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from benchmarks.speed import timing
import torch

from infhip.methods.infinitehip import infinitehip_config
from infhip.plugins.kv_offload import HostKV, copy_pages
from infhip.plugins.paged_kv import PagedKV
from infhip.plugins.infinitehip import (MASK_LAYOUTS, plan_query_blocks, pruning_stage, sparse_decode_attention,
                                        sparse_prefill_attention, unrotate_keys, write_key_bank)
from infhip.methods.infinitehip.runtime.mask_cache import refresh_from

from benchmarks.speed import one_layer, tiny
from benchmarks.speed.one_layer import (CHUNK, D, HKV, HQ, NUM_LAYERS, PAGE, SCALE, PagedContext, parse_len, sdpa_decode_us,
                       sdpa_prefill_ms, styles)


def decode_step_types(ctx: PagedContext, cfg, bs: int, reps: int, gen, profile_dir: Path | None = None,
                      mask_layout: str = "shared") -> dict:
    """µs per layer of each decode step type (first recomputed stage 0..S, S = none), per stage.
    A per-head mask_layout: no key bank and no launch-variant sweeps."""
    shared = mask_layout == "shared"
    stages, S = cfg.stages, len(cfg.stages)
    q = torch.randn(bs, HQ, D, device=one_layer.DEVICE, dtype=torch.bfloat16, generator=gen)
    tables = ctx.table.expand(bs, -1).contiguous()
    q_start = torch.arange(bs, dtype=torch.int32, device=one_layer.DEVICE)
    ones = torch.ones(bs, dtype=torch.int32, device=one_layer.DEVICE)
    ends = torch.full((bs,), ctx.n, dtype=torch.int32, device=one_layer.DEVICE)
    middle = max(0, ctx.n - cfg.n_stream - cfg.n_sink)
    prune_rope, attn_rope = styles(ctx.n, cfg)
    kw = dict(n_sink=cfg.n_sink, n_stream=cfg.n_stream, inv_freq=ctx.inv_freq)
    cache = []  # stage outputs of a full recompute (the mask cache)

    def stage(i, **over):  # over: tuning overrides, or another rope_style
        prev = (None, None) if i == 0 else cache[i - 1]
        return pruning_stage(q, ctx.paged, tables, q_start, ones, ends, *prev, **dict(
            dict(chunk_size=stages[i].chunk_size, k=stages[i].k, block_q=1, mask_layout=mask_layout,
                 max_candidates=middle if i == 0 else None, rope_style=prune_rope, **kw), **over))

    for i in range(S):
        cache.append(stage(i))
    out = torch.empty_like(q)
    # the rotated key bank (key_bank.py), past the trained window only: its rows are slot 0
    bank = (torch.empty(1, stages[-1].k, HKV, D, device=one_layer.DEVICE, dtype=torch.bfloat16)
            if attn_rope != "none" and shared else None)
    bank_rows = torch.zeros(bs, dtype=torch.int32, device=one_layer.DEVICE)

    def write_bank():
        write_key_bank(ctx.paged, tables, ends, cache[-1][0], bank, bank_rows, n_sink=cfg.n_sink,
                       inv_freq=ctx.inv_freq, rope_group=stages[-1].chunk_size)

    def attend(**over):  # over: tuning overrides, bank=, or another rope_style
        sparse_decode_attention(q, ctx.paged, tables, ends, cache[-1][0], scale=SCALE, out=out,
                                **dict(dict(rope_style=attn_rope, rope_group=stages[-1].chunk_size, **kw), **over))

    def step(first, with_bank=False):
        def run():
            for i in range(first, S):
                stage(i)  # fresh outputs; the cached ones stay as the later stages' inputs
            if with_bank:
                if first < S:  # the last stage refreshed: its keys go to the bank
                    write_bank()
                attend(bank=bank, bank_rows=bank_rows)
            else:
                attend()
        return run

    per_type = {first: timing.graph_time_us(step(first), reps) for first in range(S + 1)}
    per_type_bank = None
    if bank is not None:  # the same steps with the bank
        write_bank()
        per_type_bank = {first: timing.graph_time_us(step(first, with_bank=True), reps) for first in range(S + 1)}
    if profile_dir is not None:
        text = profile_step(step(0), profile_dir / f"decode_kernels_{ctx.n}_{stages[-1].chunk_size}.txt")
        print(f"[{ctx.n}] kernels of a full-refresh decode step:\n{text}", flush=True)
    per_stage = {f"stage{i + 1}": timing.graph_time_us(lambda i=i: stage(i), reps) for i in range(S)}
    per_stage["attention"] = per_type[S]
    if not shared:
        return {"step_us": per_type, "step_us_bank": None, "stage_us": per_stage}
    for i in range(S):  # launch configurations (defaults: docs/benchmarks.md)
        variants = DECODE_STAGE1_VARIANTS if i == 0 else DECODE_LATER_STAGE_VARIANTS
        per_stage[f"stage{i + 1}_variants"] = {str(v): timing.graph_time_us(lambda i=i, v=v: stage(i, **v), reps)
                                               for v in variants}
    per_stage["attention_variants"] = {str(v): timing.graph_time_us(lambda v=v: attend(**v), reps)
                                       for v in DECODE_ATTN_VARIANTS}
    if bank is not None:  # how much of the cached step is the keys' re-rotation (dynamic RoPE)
        per_stage["attention_bank"] = per_type_bank[S]
        per_stage["attention_bank_variants"] = {str(v): timing.graph_time_us(
            lambda v=v: attend(bank=bank, bank_rows=bank_rows, **v), reps) for v in DECODE_BANK_ATTN_VARIANTS}
        per_stage["bank_write"] = timing.graph_time_us(write_bank, reps)
        per_stage["attention_without_rope"] = timing.graph_time_us(lambda: attend(rope_style="none"), reps)
        per_stage["stage1_without_rope"] = timing.graph_time_us(lambda: stage(0, rope_style="none"), reps)
    return {"step_us": per_type, "step_us_bank": per_type_bank, "stage_us": per_stage}


def cycle_stats(step_us: dict, intervals: tuple[int, ...]) -> dict:
    """Amortized per-layer time over one refresh cycle (steps 1..n_refresh(0) after the first,
    which computes everything), and whole-model (32 layers) step totals over the cycle with
    synchronized vs layer-staggered refresh phases."""
    cycle = intervals[0]
    steps = range(1, cycle + 1)
    amortized = sum(step_us[refresh_from(j, j, intervals)] for j in steps) / cycle

    def spikes(phase_of_layer) -> dict:
        totals = [sum(step_us[refresh_from(j, j + phase_of_layer(layer), intervals)] for layer in range(NUM_LAYERS))
                  for j in steps]
        med = statistics.median(totals)
        p99 = sorted(totals)[min(len(totals) - 1, math.ceil(0.99 * len(totals)) - 1)]
        return {"median_us": med, "p99_us": p99, "max_us": max(totals), "p99_over_median": p99 / med}

    return {"amortized_us": amortized, "synchronized": spikes(lambda layer: 0),
            "layer_staggered": spikes(lambda layer: (layer * cycle) // NUM_LAYERS)}


# defaults first (tiles, block_c swept 2026-11-30: within 10%); keys_as_rows: transposed score tiles
# num_warps 16: half the registers per thread for the 256-row tiles (ncu, 2026-12-01: 255 + spills)
PRUNE_VARIANTS = [dict(), dict(num_warps=8), dict(keys_as_rows=True), dict(num_warps=16)]
# prefetch: each key tile's tokens and page entries loaded one tile ahead (the prefill default);
# num_stages: Triton's software pipelining depth (prefill default: 2 with STREAMING, else 3)
ATTN_VARIANTS = [dict(), dict(prefetch=False, num_stages=3), dict(prefetch=True, num_stages=2),
                 dict(prefetch=True, num_stages=3), dict(block_n=64), dict(num_warps=16),
                 dict(num_warps=16, block_n=64), dict(num_warps=16, num_stages=3)]
DECODE_STAGE1_VARIANTS = [dict(), dict(block_c=16), dict(block_c=32), dict(num_warps=8), dict(keys_as_rows=True)]  # default: 64 (dynamic RoPE), else 32
DECODE_LATER_STAGE_VARIANTS = [dict(), dict(block_c=16), dict(block_c=64), dict(num_warps=2), dict(keys_as_rows=True)]  # default: 32
# decode attention split counts / key tiles (default: ~2 waves of SMs, 64-key tiles)
DECODE_ATTN_VARIANTS = [dict(), dict(num_splits=16), dict(num_splits=52), dict(block_n=32),
                        dict(block_n=32, num_splits=64), dict(block_n=32, num_splits=104), dict(prefetch=True)]
DECODE_BANK_ATTN_VARIANTS = [dict(), dict(prefetch=True), dict(num_stages=2), dict(prefetch=True, num_stages=2)]


def offload_past(ctx: PagedContext, cfg):
    """(host twin, page table) with the pages the runtime would have offloaded when a 32K chunk
    ending at ctx.n is prefilled (runtime/kv_cache.py: all but the sink's and the last n_stream
    tokens' before the chunk; the chunk's own pages are on the GPU) copied to pinned host memory
    and named there (plugins/kv_offload.py)."""
    lo = -(-cfg.n_sink // PAGE)
    hi = max(lo, (ctx.n - CHUNK - cfg.n_stream) // PAGE)
    host = HostKV.like(ctx.k_cache, max(1, hi - lo))
    dst = -1 - torch.arange(hi - lo, device=one_layer.DEVICE, dtype=torch.int32)
    copy_pages(PagedKV(ctx.k_cache, ctx.v_cache, host=host), ctx.table[0, lo:hi].contiguous(), dst)
    table = ctx.table.clone()
    table[0, lo:hi] = dst
    tiny.sync()
    return host, table


def prefill_breakdown(ctx: PagedContext, cfg, gen, raw_keys: bool = False, offload=None,
                      mask_layout: str = "shared") -> dict:
    """ms of each stage and of the attention for a 32K chunk ending at ctx.n (all fresh, each
    stage with cfg.query_strides; raw_keys: with dynamic RoPE, keys un-rotated once first, as
    the runtime does, timed as "unrotate"); each part timed for a few launch configurations
    (tuning overrides), the fastest counted. offload: (host twin, page table) of offload_past:
    the kernels read the offloaded pages from host memory. A per-head mask_layout: the default
    launches only."""
    prune_variants, attn_variants = (PRUNE_VARIANTS, ATTN_VARIANTS) if mask_layout == "shared" else ([{}], [{}])
    q = torch.randn(CHUNK, HQ, D, device=one_layer.DEVICE, dtype=torch.bfloat16, generator=gen)
    bq = cfg.block_q
    starts, lens, ends, seq = plan_query_blocks([CHUNK], [ctx.n], bq, device=one_layer.DEVICE)
    host, table = offload if offload is not None else (None, ctx.table)
    kv = ctx.paged.with_host(host)
    tables = table.expand(starts.shape[0], -1).contiguous()
    middle = max(0, ctx.n - cfg.n_stream - cfg.n_sink)
    prune_rope, attn_rope = styles(ctx.n, cfg)
    kw = dict(n_sink=cfg.n_sink, n_stream=cfg.n_stream, inv_freq=ctx.inv_freq)
    res, variants = {}, {}
    layout = dict(mask_layout=mask_layout)
    if raw_keys and prune_rope != "none":
        unrotate = lambda: unrotate_keys(kv, table, [ctx.n], ctx.inv_freq, seq.long())  # noqa: E731
        res["unrotate"] = timing.event_ms(unrotate, reps=3)
        kw["raw_keys"] = unrotate()
    outs = []
    for i, st in enumerate(cfg.stages):
        prev = (None, None) if i == 0 else outs[-1]
        outs.append(pruning_stage(q, kv, tables, starts, lens, ends, *prev, chunk_size=st.chunk_size,
                                  k=st.k, block_q=bq, max_candidates=middle if i == 0 else None,
                                  rope_style=prune_rope, query_stride=cfg.query_strides[i], **layout, **kw))
    for i, st in enumerate(cfg.stages):
        prev = (None, None) if i == 0 else outs[i - 1]
        times = [timing.event_ms(lambda st=st, prev=prev, i=i, v=v: pruning_stage(
            q, kv, tables, starts, lens, ends, *prev, chunk_size=st.chunk_size, k=st.k, block_q=bq,
            max_candidates=middle if i == 0 else None, rope_style=prune_rope,
            query_stride=cfg.query_strides[i], **layout, **kw, **v), reps=3)
            for v in prune_variants]
        res[f"stage{i + 1}"] = times[0]  # the default launch (what the runtime runs); others: variants_ms
        variants[f"stage{i + 1}"] = {str(v): t for v, t in zip(prune_variants, times)}
    kw.pop("raw_keys", None)
    out = torch.empty_like(q)
    times = [timing.event_ms(lambda v=v: sparse_prefill_attention(
        q, kv, tables, starts, lens, ends, outs[-1][0], block_q=bq, scale=SCALE,
        rope_style=attn_rope, rope_group=cfg.stages[-1].chunk_size, out=out, **kw, **v), reps=3)
        for v in attn_variants]
    res["attention"] = times[0]
    variants["attention"] = {str(v): t for v, t in zip(attn_variants, times)}
    if attn_rope != "none":  # the keys' re-rotation share (not counted in the total)
        variants["attention_without_rope"] = timing.event_ms(lambda: sparse_prefill_attention(
            q, kv, tables, starts, lens, ends, outs[-1][0], block_q=bq, scale=SCALE,
            rope_style="none", out=out, **kw), reps=3)
    res["total"] = sum(res.values())
    res["variants_ms"] = variants
    return res


def profile_step(fn, path: Path) -> str:
    """Per-kernel GPU time of one captured call of fn (torch.profiler), written to path."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    rows = sorted(((e.key, e.device_time_total / 10, e.count // 10) for e in prof.key_averages()
                   if e.device_time_total > 0), key=lambda r: -r[1])
    text = "\n".join(f"{us:9.1f} us {n:4d}x  {name[:90]}" for name, us, n in rows)
    path.write_text(text + "\n")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--contexts", default="128k,1m")
    ap.add_argument("--presets", default="3k,3k-fast,3k-flash,5k")
    ap.add_argument("--mask-layouts", default="shared",
                    help=f"comma-separated, of {', '.join(MASK_LAYOUTS)} (per-head layouts: decode step types "
                    "and the preset's prefill, ratio to shared)")
    ap.add_argument("--reps", type=int, default=20, help="copies of a decode step per CUDA graph")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--no-decode", action="store_true", help="prefill only")
    ap.add_argument("--prefill-configs", choices=("all", "preset"), default="all",
                    help="preset: the preset's own strides (with raw keys past the window) only")
    ap.add_argument("--offload", action="store_true",
                    help="also the preset's prefill with the past pages in pinned host memory (KV offloading)")
    ap.add_argument("--smoke", action="store_true", help="a tiny layer on the CPU (tiny.py): the code path, not speed")
    args = ap.parse_args()
    if args.smoke:  # the layer's constants, re-read from one_layer after it shrinks them
        one_layer.shrink()
        globals().update({k: getattr(one_layer, k) for k in ("CHUNK", "D", "HKV", "HQ", "SCALE")})
        args.reps = min(args.reps, 2)
    layouts = [x.strip() for x in args.mask_layouts.split(",")]
    for x in layouts:
        if x not in MASK_LAYOUTS:
            ap.error(f"--mask-layouts: {x!r} is not one of {', '.join(MASK_LAYOUTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=one_layer.DEVICE).manual_seed(0)
    presets = [p.strip() for p in args.presets.split(",")]
    results = {"device": tiny.gpu_name(), "torch": torch.__version__,
               "triton": __import__("triton").__version__, "mask_layouts": layouts, "contexts": {}}
    rows = []
    for n in sorted({tiny.cap(parse_len(c), args.smoke) for c in args.contexts.split(",")}):
        ctx = PagedContext(n, gen)
        r = {"sdpa_decode": sdpa_decode_us(ctx, args.reps, gen)}
        print(f"[{n}] SDPA decode {r['sdpa_decode']}", flush=True)
        if not args.no_prefill:
            r["sdpa_prefill"] = sdpa_prefill_ms(ctx, gen)
            print(f"[{n}] SDPA prefill {r['sdpa_prefill']}", flush=True)
        decode_by_stages = {}
        for name in presets:
            cfg = (infinitehip_config(name, tiny.TINY_IH, trained_window=one_layer.TRAINED_WINDOW) if args.smoke
                   else infinitehip_config(name))
            for layout in layouts:
                measure_preset(args, ctx, cfg, name, layout, r, rows, decode_by_stages, gen)
        results["contexts"][n] = r
        del ctx
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    (args.out / "bench_infinitehip.json").write_text(json.dumps(results, indent=1, default=str))
    print("\n| keys | preset | phase | infhip µs/layer | SDPA µs/layer | speedup | vs shared (time) | "
          "P99/med synced | P99/med staggered |")
    print("|---|---|---|---|---|---|---|---|---|")
    shared = {(n, name, phase): ours for n, name, phase, ours, *_ in rows}
    for n, name, phase, ours, base, sp, p_sync, p_stag, layout in rows:
        f = lambda x: "—" if x is None else f"{x:.2f}"  # noqa: E731
        ref = shared.get((n, name[:-len(layout) - 1], phase)) if layout != "shared" else None
        print(f"| {n} | {name} | {phase} | {ours:.1f} | {base:.1f} | {sp:.1f}× | {f(ref and ours / ref)} | "
              f"{f(p_sync)} | {f(p_stag)} |")


def measure_preset(args, ctx: PagedContext, cfg, name: str, layout: str, r: dict, rows: list,
                   decode_by_stages: dict, gen) -> None:
    """One preset in one mask layout at context ctx.n: decode (amortized over the refresh cycle,
    with the key bank where it applies) and, for 3k / 5k, prefill; results into r (JSON) and
    rows (the table: label, phase, µs, SDPA µs, speedup, spikes, layout)."""
    n = ctx.n
    label0 = name if layout == "shared" else f"{name} {layout}"
    key = (tuple(cfg.stages), layout)
    if not args.no_decode and key not in decode_by_stages:  # 3k / -fast / -flash: time once
        decode_by_stages[key] = decode_step_types(ctx, cfg, 1, args.reps, gen,
                                                  args.out if name == "3k" and layout == "shared"
                                                  and not args.smoke else None,  # (a CUDA profile)
                                                  mask_layout=layout)
        print(f"[{n}] {label0} decode step types (us): {decode_by_stages[key]}", flush=True)
    if not args.no_decode:
        d = dict(decode_by_stages[key])
        d.update(cycle_stats(d["step_us"], cfg.refresh_intervals))
        d["speedup_vs_sdpa"] = r["sdpa_decode"]["us"] / d["amortized_us"]
        r[f"decode_{label0}"] = d
        rows.append((n, label0, "decode", d["amortized_us"], r["sdpa_decode"]["us"], d["speedup_vs_sdpa"],
                     d["synchronized"]["p99_over_median"], d["layer_staggered"]["p99_over_median"], layout))
        if d["step_us_bank"] is not None:
            b = cycle_stats(d["step_us_bank"], cfg.refresh_intervals)
            b["speedup_vs_sdpa"] = r["sdpa_decode"]["us"] / b["amortized_us"]
            r[f"decode_{name}_bank"] = b
            rows.append((n, f"{name} key bank", "decode", b["amortized_us"], r["sdpa_decode"]["us"],
                         b["speedup_vs_sdpa"], b["synchronized"]["p99_over_median"],
                         b["layer_staggered"]["p99_over_median"], "shared"))
    if args.no_prefill or name not in ("3k", "5k"):
        return
    # the preset's query strides, the paper's formula (every query scores, 1, 1, 1) and the
    # preset's coarsest stride in every stage (4, 4, 4: the speed side of that quality trade,
    # docs/quality.md); with dynamic RoPE (past the trained window) from un-rotated keys as the
    # runtime does, and the preset's also without them. Per-head layouts: the preset's only.
    dynamic = styles(n, cfg)[0] != "none"
    paper = (1,) * len(cfg.stages)
    coarsest = (max(cfg.query_strides),) * len(cfg.stages)
    configs = [(cfg.query_strides, dynamic)]
    if args.prefill_configs == "all" and layout == "shared":
        configs += [(paper, dynamic), (coarsest, dynamic)] + ([(cfg.query_strides, False)] if dynamic else [])
    runs = [(strides, raw, False) for strides, raw in dict.fromkeys(configs)]
    runs += [(cfg.query_strides, dynamic, True)] if args.offload and layout == "shared" else []
    for strides, raw, offloaded in runs:
        label = name if strides == cfg.query_strides else f"{name} strides {strides}"
        label += (" raw keys" if raw else "") + (" offloaded" if offloaded else "")
        label += "" if layout == "shared" else f" {layout}"
        p = prefill_breakdown(ctx, cfg.replace(query_strides=strides), gen, raw_keys=raw,
                              offload=offload_past(ctx, cfg) if offloaded else None, mask_layout=layout)
        p["speedup_vs_sdpa"] = r["sdpa_prefill"]["ms"] / p["total"]
        r[f"prefill_{label}"] = p
        print(f"[{n}] {label} prefill (ms): { {k: v for k, v in p.items() if k != 'variants_ms'} }", flush=True)
        print(f"[{n}] {label} prefill variants (ms): {p['variants_ms']}", flush=True)
        rows.append((n, label, "prefill", p["total"] * 1e3, r["sdpa_prefill"]["ms"] * 1e3,
                     p["speedup_vs_sdpa"], None, None, layout))


if __name__ == "__main__":
    main()
