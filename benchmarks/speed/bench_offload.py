"""Decode with the KV cache offloaded to host memory vs resident on the GPU: Llama-3.1-8B shapes,
random weights, one H200, batch 1, through the runtime (CUDA graphs, scheduler), 3k-flash.

    python -m benchmarks.speed.bench_offload --out $OUT [--contexts 512000] [--kv-dtype fp8]

Per context, in one process:
1. resident: an engine whose GPU cache holds the whole context; dense (the baseline) and the
   InfiniteHiP configs decode one request (bench_decode_e2e.py's synthetic request: random K/V,
   the first N - 1 tokens count as computed);
2. offloaded: the same engine loaded again with a small GPU cache and ``kv_offload_bytes`` for
   the rest; the request is grown chunk by chunk, each chunk's middle pages moved to the host
   pool as the runtime moves them after a prefill step (so the GPU never holds the context),
   then decodes under the same InfiniteHiP configs. Stage refreshes read the offloaded keys in
   place (zero-copy over PCIe); cached steps read the key bank, sink and stream from the GPU and
   the selected values from the host.

3. with --prefill-chunk (default 32768): the wall time of one step that prefills the last chunk
   of an n-token request (3k-flash), resident, and offloaded with the chunk's host pages staged
   to the GPU a layer ahead (runtime/offload/staging.py) and read in place.

`--smoke` (benchmarks/speed/tiny.py): the same steps on the CPU, a tiny Llama, contexts cut to
200 tokens, chunks of 64, a few steps per config, the "GPU" cache 320 tokens (what the runtime
asks of a 712-token engine).

Reports median step time, P99, fused tok/s, GPU KV bytes (the pool, and the request's pages in
it), and ratios against the resident run of the same config and against dense, all timed in
this run. Prints tables last; JSON to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.speed import tiny
from benchmarks.speed.bench_decode_e2e import build, fill_random, fused_tok_s, p99, step_times_ms

GiB = 1 << 30
CONFIGS = {"3k-flash": dict(refresh_intervals=(96, 24, 8)), "3k": dict(refresh_intervals=(16, 8, 4))}


def config_knobs(name: str) -> dict:
    """Runtime knobs of a config: a name in CONFIGS, or ``r<n1>-<n2>-<n3>`` for those refresh
    intervals (e.g. r256-8-4: stage 1 almost never, to take its refreshes out of a breakdown)."""
    if name in CONFIGS:
        return CONFIGS[name]
    if name.startswith("r") and all(x.isdigit() for x in name[1:].split("-")):
        return dict(refresh_intervals=tuple(int(x) for x in name[1:].split("-")))
    raise SystemExit(f"unknown config {name!r}: use one of {', '.join(CONFIGS)} or r<n1>-<n2>-<n3>")


def grown_request(llm, n: int, chunk: int = 32768, computed: int | None = None):
    """bench_decode_e2e.synthetic_request, but its pages are appended a chunk at a time and
    offloaded after each (runner.page_mover, as ModelRunner.execute ends a step; none without host memory). ``computed`` (default
    n - 1) tokens count as computed: the next step prefills the rest."""
    from infhip import SamplingParams
    from infhip.runtime.sequence import SequenceStatus

    vocab = llm.engine.config.model.vocab_size
    ids = torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    req = llm.core.add_request(None, ids, SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True))
    seq, sched = req.seq, llm.scheduler
    sched.waiting.remove(seq)
    computed = n - 1 if computed is None else computed
    mover = llm.runner.page_mover  # None on an engine loaded without host memory (resident): nothing moves
    for start in range(0, computed, chunk):
        end = min(computed, start + chunk)
        sched.kv.append(seq.seq_id, start, end)
        if mover is not None:
            mover.move([(seq, end)])
    seq.status = SequenceStatus.RUNNING
    sched.running.append(seq)
    seq.num_computed_tokens = computed
    return seq


def prefill_ms(llm, n: int, chunk: int = 32768) -> float:
    """Wall time of one step that prefills the last ``chunk`` tokens of an n-token request whose
    first n - chunk are cached (offloaded as the runtime would have); the second of two such
    steps, each on a fresh request (the first compiles: the pruning kernels' tiling constants
    depend on the context, so a shorter warm-up would not do)."""
    times = []
    for _ in range(2):
        seq = grown_request(llm, n, chunk=chunk, computed=n - chunk)
        tiny.sync()
        t = time.perf_counter()
        llm.core.step()  # the chunk (32 layers of pruning + block-sparse attention), then its sampled token
        tiny.sync()
        times.append((time.perf_counter() - t) * 1e3)
        llm.scheduler.finish(seq, "abort")
    return times[-1]


def measure(llm, configs: list[str], plan, with_dense: bool, smoke: bool = False) -> dict:
    rows = {}
    todo = ([("dense", dict(dense_threshold=1 << 40))] if with_dense else []) + [(c, config_knobs(c)) for c in configs]
    for name, knobs in todo:
        ih = plan.at_load({"infinitehip": knobs}).knobs_of("infinitehip")
        llm.runner.set_backend("infinitehip", ih)
        cycle = ih.refresh_intervals[0] if name != "dense" else 8
        step_times_ms(llm, 2 if smoke else cycle + 8)  # warm-up: every refresh pattern's graph
        times = step_times_ms(llm, 4 if smoke else max(64, 2 * cycle))  # whole cycles: the mean is the amortized step
        med = statistics.median(times)
        rows[name] = {"median_ms": med, "mean_ms": statistics.fmean(times), "p99_ms": p99(times),
                      "fused8_tok_s": fused_tok_s(llm, 8 if smoke else 96), "step_ms": times}
        print(f"  {name:<13} median {med:7.2f} ms  mean {rows[name]['mean_ms']:7.2f}  P99 {p99(times):7.2f}  "
              f"fused {rows[name]['fused8_tok_s']:7.1f} tok/s", flush=True)
    return rows


def kv_bytes(llm) -> tuple[int, int]:
    """(GPU, host) bytes of the KV caches (and fp8 scales) of all layers."""
    gpu = host = 0
    for layer in llm.engine.model.layers:
        a = layer.self_attn
        for t in (a.kv.k, a.kv.v, a.kv.k_scale, a.kv.v_scale):
            gpu += 0 if t is None else t.numel() * t.element_size()
        if a.kv.host is not None:
            for t in (a.kv.host.k, a.kv.host.v, a.kv.host.k_scale, a.kv.host.v_scale):
                host += 0 if t is None else t.numel() * t.element_size()
    return gpu, host


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/infhip-offload"))
    p.add_argument("--contexts", default="512000")
    p.add_argument("--kv-dtype", choices=("bfloat16", "fp8"), default="fp8")
    p.add_argument("--configs", default="3k-flash,3k")
    p.add_argument("--gpu-kv-gib", type=float, default=16,
                   help="GPU KV cache of the offloaded run: it holds a request whole until it passes the "
                        "trained window (128K for Llama-3.1-8B, ~10.3 GiB in fp8), the sink + stream after")
    p.add_argument("--prefill-chunk", type=int, default=32768,
                   help="also time one prefill step of this many tokens at each context (0: skip)")
    p.add_argument("--in-place-max", type=int, default=1 << 40,
                   help="contexts above this time no in-place offloaded prefill (it takes minutes to set up)")
    p.add_argument("--resident-max", type=int, default=None,
                   help="contexts above this get no resident run (it would not fit the GPU); their "
                        "ratios are against the resident run of the largest context at or below it")
    p.add_argument("--smoke", action="store_true", help="tiny engine on the CPU: the code path, not speed")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    contexts = sorted({tiny.cap(int(x), args.smoke) for x in args.contexts.split(",")})
    chunk = min(args.prefill_chunk, 64) if args.smoke else args.prefill_chunk  # 64: the tiny engine's chunk
    grow = 64 if args.smoke else 32768
    configs = args.configs.split(",")

    import triton

    from infhip import LLM

    res = {"gpu": tiny.gpu_name(), "torch": torch.__version__, "triton": triton.__version__,
           "kv_dtype": args.kv_dtype, "contexts": {}}
    # The resident runs get an engine whose max_seq_len its GPU can hold (one sequence's pages are
    # reserved); the offloaded ones one for the largest context.
    resident_max = max(n for n in contexts if args.resident_max is None or n <= args.resident_max)
    room = 512 if args.smoke else 8192
    engine = build(args.work, max(contexts) + room, args.kv_dtype, smoke=args.smoke)
    resident_engine = engine if resident_max == max(contexts) else build(
        args.work / "resident", resident_max + room, args.kv_dtype, smoke=args.smoke)
    per_token = None
    for n in contexts:
        out = res["contexts"][str(n)] = {}
        too_big = args.resident_max is not None and n > args.resident_max
        offloaded = ["offloaded"]
        for mode in offloaded if too_big else ["resident"] + offloaded:
            t0 = time.perf_counter()
            if mode == "resident":
                llm = LLM(resident_engine, max_num_seqs=1, kv_cache_memory_bytes=(64 << 20) if args.smoke else None,
                          prefix_caching=False)
            elif per_token is None:
                raise SystemExit("the first context needs a resident run (it sizes the host pool)")
            else:  # "offloaded": the sparse kernels read host pages in place
                gpu_kv = 320 * per_token if args.smoke else int(args.gpu_kv_gib * GiB)
                llm = LLM(engine, max_num_seqs=1, kv_cache_memory_bytes=gpu_kv,
                          kv_offload_bytes=int(1.03 * n * per_token))
            for layer in llm.engine.model.layers:
                fill_random(layer.self_attn)
            plan = llm.engine.config.plan
            gpu_b, host_b = kv_bytes(llm)
            if per_token is None:  # bytes of one token's K/V (+ scales) over all layers
                a = llm.engine.model.layers[0].self_attn
                per_token = len(llm.engine.model.layers) * 2 * (a.kv.k[0, 0].numel() * a.kv.k.element_size()
                                                                + (4 * a.kv.k.shape[2] if a.kv.k_scale is not None else 0))
            seq = grown_request(llm, n, chunk=grow) if mode != "resident" else grown_request(llm, n, chunk=n)
            print(f"{n} {mode}: GPU KV {gpu_b / GiB:.1f} GiB, host KV {host_b / GiB:.1f} GiB, "
                  f"set-up {time.perf_counter() - t0:.0f} s", flush=True)
            rows = measure(llm, configs, plan, with_dense=mode == "resident", smoke=args.smoke)
            gpu_used = torch.cuda.memory_allocated() / GiB if torch.cuda.is_available() else 0.0
            on_gpu = sum(p >= 0 for p in llm.runner.kv.page_list(seq.seq_id, "global"))
            request_gib = on_gpu * per_token * llm.runner.page_size / GiB  # its pages in the GPU pool
            llm.scheduler.finish(seq, "abort")
            out[mode] = {"gpu_kv_gib": gpu_b / GiB, "host_kv_gib": host_b / GiB, "gpu_allocated_gib": gpu_used,
                         "request_gpu_kv_gib": request_gib, "rows": rows, "prefill_ms": {}}
            if args.prefill_chunk:  # one chunk at context n, 3k-flash (the engine's preset)
                llm.runner.set_backend("infinitehip", plan.knobs_of("infinitehip"))
                variants = ({"resident": True} if mode == "resident" else
                            {"staged": True, "in place": False} if n <= args.in_place_max else {"staged": True})
                for name, staged in variants.items():
                    if llm.runner.staging is not None:
                        llm.runner.staging.enabled = staged
                    ms = out[mode]["prefill_ms"][name] = prefill_ms(llm, n, chunk)
                    print(f"  prefill {chunk} at {n}, {name}: {ms:.0f} ms", flush=True)
            del llm, seq
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    (args.out / "bench_offload.json").write_text(json.dumps(res, indent=2))
    print(f"\n{res['gpu']}  torch {res['torch']}  triton {res['triton']}; Llama-3.1-8B shapes, random weights, "
          f"bf16 weights, KV {args.kv_dtype}, batch 1, CUDA graphs; ratios in this run")
    print(f"{'context':>8} {'config':<13}{'mode':<10}{'req KV GiB':>11}{'median ms':>10}{'mean ms':>9}{'P99/med':>8}"
          f"{'tok/s':>8}{'x resident':>11}{'x dense':>8}")
    resident = None
    for n, modes in res["contexts"].items():
        resident = modes.get("resident", resident)  # else: the largest context's that had one
        dense = resident["rows"]["dense"]
        for mode, m in modes.items():
            for name, r in m["rows"].items():
                base = resident["rows"][name]
                tok_s = r["fused8_tok_s"]
                print(f"{n:>8} {name:<13}{mode:<10}{m['request_gpu_kv_gib']:>11.1f}{r['median_ms']:>10.2f}"
                      f"{r['mean_ms']:>9.2f}{r['p99_ms'] / r['median_ms']:>8.2f}{tok_s:>8.1f}"
                      f"{tok_s / base['fused8_tok_s']:>11.2f}{tok_s / dense['fused8_tok_s']:>8.2f}")
    if args.prefill_chunk:
        print(f"\nprefill of one {chunk}-token chunk (3k-flash, all layers, wall ms; "
              "x resident = resident time / this time)")
        resident = None
        for n, modes in res["contexts"].items():
            resident = modes.get("resident", resident)
            base = resident["prefill_ms"]["resident"]
            for mode, m in modes.items():
                for name, ms in m["prefill_ms"].items():
                    print(f"{n:>8} {mode:<10}{name:<10}{ms:>10.0f} ms{base / ms:>8.2f}x resident")


if __name__ == "__main__":
    main()
