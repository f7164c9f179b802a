"""Whole-model decode at long context: InfiniteHiP presets vs the dense engine, Llama-3.1-8B
shapes, random weights, bf16, one GPU, batch 1, through the runtime (CUDA graphs, scheduler).

    python -m benchmarks.speed.bench_decode_e2e --out $OUT [--contexts 128000,512000] [--kv-dtype fp8]

One random-weight engine (preset 3k-flash) is built and loaded once. Its KV cache is filled with
random keys and values, and a request whose first N - 1 tokens count as already computed
decodes from there (a prefill of 512K tokens would take minutes; decode time does not depend
on what the keys hold, only on how many there are). The same request then decodes under each
configuration, switched on the same runner (`ModelRunner.set_backend`, runtime knobs only):

- dense: dense_threshold above the context, so every layer runs the dense paged decode kernel
  (the strongest decode baseline we have: flash-decoding over the paged cache, in a CUDA graph);
- 3k / 3k-fast / 3k-flash: the presets' refresh intervals with layer-staggered refresh and the
  rotated key bank past the trained window (the presets' defaults; plugins/infinitehip/key_bank.py);
- 3k-flash synchronized: every layer refreshes together (the paper's schedule);
- 3k-flash no bank: keys rotated at every step (key_bank=False; before 6a1477b the presets'
  default, so the "3k*" rows of earlier runs are this).

Per configuration: a warm-up of one refresh cycle (captures the graph of every refresh pattern),
then per-step wall times of single steps over two cycles (host planning, graph replay, sampling,
the sync of the sampled token: what a streaming user sees) — median, P99, max — and the
throughput of 8 steps fused per host sync (the engine default). Ratios are against dense in the
same run, and against the same config at the shortest context (the goal "1M decode >= 0.9x of
short-context decode": `--contexts 1024,1000000`). Prints a table last and writes JSON to --out
(after every context, so a run cut short keeps what it measured).

`--weight-dtype fp8` builds the engine with fp8 linear weights (docs/fp8_weights.md).
`--tp N` builds it tensor-parallel (N GPUs; docs/design/tensor_parallel.md): rank 0 owns the
scheduler and the page tables, so the synthetic request and the knob switches reach every rank
through the runtime; rank 0's pages get the random keys and values, the workers' keep the zeros
they were allocated with (decode time depends on how many keys there are, not on what they hold).
Run it beside a `--tp 1` run of the same contexts for the ratio (3k-flash at 1M):

    python -m benchmarks.speed.bench_decode_e2e --out $OUT/tp2 --contexts 1024,1000000 --configs dense,3k-flash \
        --kv-dtype fp8 --tp 2
`--max-resident`: before loading, find the largest context one request of this engine holds
resident on this GPU, from the runtime's own budgeting (`resident_probe`: the engine's weights
loaded, then runtime/kv_budget.plan_layout at max_num_seqs = 1 with the default budget, for the
largest max_seq_len it does not refuse); then load with that max_seq_len and the default budget
(what `LLM(engine)` allocates) and decode at that context too (less the tokens the runs decode).

    python -m benchmarks.speed.bench_decode_e2e --out $OUT --contexts 1024,1000000 --configs dense,3k-flash \
        --kv-dtype fp8 --weight-dtype fp8 --max-resident

`--smoke` (benchmarks/speed/tiny.py): the same steps on the CPU with a tiny Llama, contexts cut to
200 tokens, a few steps each and a 64 MiB KV cache; --max-resident's probe reads CUDA memory, so a
smoke run skips it (and decodes at the given contexts only).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import statistics
import time
from pathlib import Path

import torch

from benchmarks.speed import tiny

CONFIGS = [  # name, runtime knobs (None: dense)
    ("dense", None),
    ("3k", dict(refresh_intervals=(16, 8, 4))),
    ("3k-fast", dict(refresh_intervals=(32, 16, 8))),
    ("3k-flash", dict(refresh_intervals=(96, 24, 8))),
    ("3k-flash sync", dict(refresh_intervals=(96, 24, 8), stagger_refresh=False)),
    ("3k-flash no bank", dict(refresh_intervals=(96, 24, 8), key_bank=False)),
    # the two chunk scores side by side (the choice of InfiniteHipConfig.chunk_score's default)
    ("3k-flash max", dict(refresh_intervals=(96, 24, 8), chunk_score="max")),
    ("3k-flash head_normalized", dict(refresh_intervals=(96, 24, 8), chunk_score="head_normalized")),
]


def build(work: Path, max_len: int, kv_dtype: str, weight_dtype: str = "bf16", tp: int = 1,
          smoke: bool = False) -> Path:
    from infhip.builder.build import build_engine

    src = tiny.write_config(work / "config.json", "llama-3.1-8b", smoke)
    kw = dict(tiny.BUILD, infinitehip_overrides=tiny.TINY_IH) if smoke else dict(dtype="bfloat16", device="cuda")
    if smoke and kv_dtype == "bfloat16":
        kv_dtype = None  # the float32 CPU engine keeps its KV in float32 (or fp8)
    return build_engine(checkpoint=src, output_dir=work / "engine", preset="3k-flash", kv_dtype=kv_dtype,
                        weight_dtype=weight_dtype, random_weights=True, max_seq_len=max_len, max_batch_size=1,
                        tp=tp, force=True, progress=False, **kw)


def set_max_seq_len(engine_dir: Path, tokens: int) -> None:
    """Rewrite the engine's max_seq_len (a load-time bound: KV pages, block tables, scratch)."""
    from infhip.config import EngineConfig

    cfg = EngineConfig.load(engine_dir)
    cfg = dataclasses.replace(cfg, build=dataclasses.replace(cfg.build, max_seq_len=tokens))
    cfg.save(engine_dir)


def resident_probe(engine_dir: Path) -> dict:
    """The largest max_seq_len (a multiple of the page size) for which the runtime's own KV sizing
    (runtime/kv_budget.plan_layout, as ModelRunner calls it right after the weights load: default
    budget = free memory - (1 - utilization) x total - activations, InfiniteHiP scratch and key
    banks for that length - 1 GiB) gives one sequence all of its pages. Loads the weights as LLM
    does, sizes, frees them again; allocates no KV."""
    from infhip.runtime import kv_budget
    from infhip.runtime.load import load_rank
    from infhip.runtime.options import LoadOptions

    utilization = LoadOptions().gpu_memory_utilization
    gc.collect()
    torch.cuda.empty_cache()  # what the build left cached would count as used
    engine = load_rank(engine_dir, LoadOptions(max_num_seqs=1))
    base, layers = engine.config, [layer.self_attn for layer in engine.model.layers]
    page, chunk = base.build.page_size, base.build.max_num_batched_tokens

    def layout(pages: int):
        tokens = pages * page
        engine.config = dataclasses.replace(base, build=dataclasses.replace(base.build, max_seq_len=tokens))
        try:
            return kv_budget.plan_layout(engine, layers, 1, chunk, None, utilization, 0, pages)
        except MemoryError:
            return None

    lo, hi = 0, 1 << 20  # pages: lo fits (0: trivially), hi (16M tokens) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if layout(mid) is not None else (lo, mid)
    free, total = torch.cuda.mem_get_info()
    weights = sum(t.numel() * t.element_size() for t in engine.model.state_dict().values())
    out = {"max_seq_len": lo * page, "page_size": page, "utilization": utilization,
           "weights_gib": weights / (1 << 30), "free_gib_with_weights": free / (1 << 30),
           "total_gib": total / (1 << 30)}
    if lo:
        specs = layout(lo).specs
        out["pages"] = {g: spec.num_pages for g, spec in specs.items()}
    del engine, layers
    gc.collect()
    torch.cuda.empty_cache()
    return out


def decode_room(wanted: list[str]) -> int:
    """Tokens the measurement of these configs decodes into one request (warm-ups, timed steps,
    fused steps: main's loop), plus a margin: a request must start this far below max_seq_len."""
    steps = 0
    for name, knobs in CONFIGS:
        if name in wanted:
            cycle = knobs["refresh_intervals"][0] if knobs else 8
            steps += cycle + 8 + max(64, 2 * cycle) + 96
    return steps + 256


def fill_random(attn, pages_per_chunk: int = 4096) -> None:
    """Random N(0, 1) keys and values in every page (scaled like real ones); an fp8 cache gets
    them quantized with their per-row scales, a chunk of pages at a time."""
    from infhip.plugins.kv_quant import quantize_rows

    for cache, scale in ((attn.kv.k, attn.kv.k_scale), (attn.kv.v, attn.kv.v_scale)):
        if scale is None:
            cache.normal_()
            continue
        for p0 in range(0, cache.shape[0], pages_per_chunk):
            x = torch.randn(cache[p0:p0 + pages_per_chunk].shape, device=cache.device, dtype=torch.bfloat16)
            cache[p0:p0 + pages_per_chunk], scale[p0:p0 + pages_per_chunk] = quantize_rows(x)


def synthetic_request(llm, n: int):
    """A request of n prompt tokens whose first n - 1 count as computed (their KV pages hold the
    cache's random contents); its next step is a decode at position n - 1."""
    from infhip import SamplingParams
    from infhip.runtime.sequence import SequenceStatus

    vocab = llm.engine.config.model.vocab_size
    ids = torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    req = llm.core.add_request(None, ids, SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True))
    seq, sched = req.seq, llm.scheduler
    sched.waiting.remove(seq)
    sched.kv.append(seq.seq_id, 0, n - 1)
    seq.status = SequenceStatus.RUNNING
    sched.running.append(seq)
    seq.num_computed_tokens = n - 1
    return seq


def step_times_ms(llm, num_steps: int) -> list[float]:
    llm.core.num_decode_steps = 1
    times = []
    for _ in range(num_steps):
        t = time.perf_counter()
        llm.core.step()  # ends with the sampled token on the host (a sync)
        times.append((time.perf_counter() - t) * 1e3)
    return times


def fused_tok_s(llm, num_tokens: int, fused: int = 8) -> float:
    llm.core.num_decode_steps = fused
    tiny.sync()
    t = time.perf_counter()
    for _ in range(num_tokens // fused):
        llm.core.step()
    tiny.sync()
    return (num_tokens // fused) * fused / (time.perf_counter() - t)


def p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/infhip-e2e"))
    p.add_argument("--contexts", default="128000,512000")
    p.add_argument("--kv-gib", type=float, default=72)
    p.add_argument("--kv-dtype", choices=("bfloat16", "fp8"), default="bfloat16")
    p.add_argument("--weight-dtype", choices=("bf16", "fp8"), default="bf16", help="the engine's linear weights")
    p.add_argument("--max-resident", action="store_true",
                   help="probe the largest resident context (runtime budgeting), load with it (default KV "
                        "budget, --kv-gib ignored) and decode at it too")
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism: N GPUs of this host (rank 0's KV "
                   "gets the random fill; --kv-gib is per rank)")
    p.add_argument("--configs", default=",".join(name for name, _ in CONFIGS),
                   help="comma-separated subset of: " + ", ".join(name for name, _ in CONFIGS))
    p.add_argument("--smoke", action="store_true", help="tiny engine on the CPU: the code path, not speed")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    contexts = sorted({tiny.cap(int(x), args.smoke) for x in args.contexts.split(",")})
    wanted = [c.strip() for c in args.configs.split(",")]
    unknown = set(wanted) - {name for name, _ in CONFIGS}
    if unknown or "dense" not in wanted:
        p.error(f"--configs: unknown {sorted(unknown)}" if unknown else "--configs must include dense (the baseline)")
    if args.tp < 1 or args.tp > max(1, torch.cuda.device_count()):
        p.error(f"--tp {args.tp}: this host shows {torch.cuda.device_count()} GPU(s); choose --tp from 1 to that")
    if args.tp > 1 and args.max_resident:
        p.error("--max-resident probes one process's memory; run it with --tp 1")

    import transformers
    import triton

    from infhip import LLM
    res: dict = {"gpu": tiny.gpu_name(), "torch": torch.__version__, "triton": triton.__version__,
                 "transformers": transformers.__version__, "kv_dtype": args.kv_dtype,
                 "weight_dtype": args.weight_dtype, "tp": args.tp, "contexts": {}}
    t0 = time.perf_counter()
    engine = build(args.work, max(contexts) + (decode_room(wanted) if args.smoke else 8192), args.kv_dtype,
                   args.weight_dtype, args.tp, args.smoke)
    kv_bytes = int((1 / 16 if args.smoke else args.kv_gib) * (1 << 30))
    if args.max_resident and args.smoke:
        print("--max-resident: skipped under --smoke (the probe reads CUDA memory)")
    elif args.max_resident:
        probe = res["max_resident"] = resident_probe(engine)
        print(f"max resident context: {probe['max_seq_len']} tokens (pages {probe.get('pages')}; weights "
              f"{probe['weights_gib']:.1f} GiB, {probe['free_gib_with_weights']:.1f} of {probe['total_gib']:.1f} GiB "
              f"free with them)", flush=True)
        if probe["max_seq_len"] <= decode_room(wanted):
            raise SystemExit("--max-resident: the runtime's budget holds no context worth decoding")
        set_max_seq_len(engine, probe["max_seq_len"])
        kv_bytes = None  # the default budget: what LLM(engine) allocates
        contexts = sorted({*(n for n in contexts if n + decode_room(wanted) <= probe["max_seq_len"]),
                           probe["max_seq_len"] - decode_room(wanted)})
    def save() -> None:
        (args.out / "bench_decode_e2e.json").write_text(json.dumps(res, indent=2))

    save()
    try:
        llm = LLM(engine, max_num_seqs=1, kv_cache_memory_bytes=kv_bytes, prefix_caching=False)
    except (MemoryError, torch.OutOfMemoryError) as e:  # --max-resident: the budget promised more than fits
        res["load_error"] = f"{type(e).__name__}: {e}"[:2000]
        save()
        raise
    if args.max_resident and not args.smoke:
        res["max_resident"]["allocated_pages"] = {g: llm.runner.kv.groups[g].num_pages for g in llm.runner.groups}
    res["setup_s"] = time.perf_counter() - t0
    runner, plan = llm.runner, llm.engine.config.plan
    for layer in llm.engine.model.layers:  # random keys and values (rank 0's shard), scaled like real ones
        fill_random(layer.self_attn)
    print(f"engine built and loaded in {res['setup_s']:.0f} s; stages {plan.knobs_of('infinitehip').stages}", flush=True)

    for n in contexts:
        seq = synthetic_request(llm, n)
        rows = res["contexts"][str(n)] = {}
        for name, knobs in [c for c in CONFIGS if c[0] in wanted]:
            knobs = knobs if knobs is not None else dict(dense_threshold=1 << 40)
            ih = plan.at_load({"infinitehip": knobs}).knobs_of("infinitehip")
            runner.set_backend("infinitehip", ih)
            cycle = ih.refresh_intervals[0] if name != "dense" else 8
            t = time.perf_counter()
            step_times_ms(llm, 2 if args.smoke else cycle + 8)  # warm-up: the first full refresh, every pattern's graph
            warm_s = time.perf_counter() - t
            times = step_times_ms(llm, 4 if args.smoke else max(64, 2 * cycle))
            tok_s = fused_tok_s(llm, 8 if args.smoke else 96)
            med = statistics.median(times)
            rows[name] = {"median_ms": med, "p99_ms": p99(times), "max_ms": max(times), "mean_ms": statistics.mean(times),
                          "p99_over_median": p99(times) / med, "fused8_tok_s": tok_s, "warmup_s": warm_s,
                          "sparse_graphs": sum(key.of("infinitehip") is not None
                                                for _, key in (runner.graphs.graphs if runner.graphs else [])),
                          "step_ms": times}
            print(f"{n:>8} {name:<14} median {med:7.2f} ms  P99 {p99(times):7.2f}  max {max(times):7.2f}  "
                  f"fused {tok_s:7.1f} tok/s  (warm-up {warm_s:.1f} s, {rows[name]['sparse_graphs']} sparse graphs)",
                  flush=True)
        llm.scheduler.finish(seq, "abort")
        save()
    llm.close()  # a --tp engine's workers stop

    print(f"\n{res['gpu']}  torch {res['torch']}  triton {res['triton']}; Llama-3.1-8B shapes, random weights, "
          f"{args.weight_dtype} weights, bf16 activations, KV {args.kv_dtype}, batch 1, TP {args.tp}; ratios vs dense "
          f"and vs the "
          f"same config at the shortest context, in the same run")
    print(f"{'context':>8} {'config':<14}{'median ms':>10}{'P99/med':>9}{'max/med':>9}{'tok/s (8 fused)':>17}"
          f"{'x dense (median)':>18}{'x dense (tok/s)':>17}{'x shortest (tok/s)':>20}")
    shortest = res["contexts"][str(min(contexts))]
    for n, rows in res["contexts"].items():
        dense = rows["dense"]
        for name, r in rows.items():
            print(f"{n:>8} {name:<14}{r['median_ms']:>10.2f}{r['p99_over_median']:>9.2f}"
                  f"{r['max_ms'] / r['median_ms']:>9.2f}{r['fused8_tok_s']:>17.1f}"
                  f"{dense['median_ms'] / r['median_ms']:>18.2f}{r['fused8_tok_s'] / dense['fused8_tok_s']:>17.2f}"
                  f"{r['fused8_tok_s'] / shortest[name]['fused8_tok_s']:>20.2f}")
    if args.max_resident and not args.smoke:
        probe = res["max_resident"]
        print(f"max resident context ({args.weight_dtype} weights, KV {args.kv_dtype}): {probe['max_seq_len']} tokens; "
              f"pages allocated {probe['allocated_pages']} of {probe['page_size']} tokens")


if __name__ == "__main__":
    main()
