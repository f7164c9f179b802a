"""Measure what decides two constants of the runtime (the figures: docs/benchmarks.md "Constants"):
RAW_KEYS_MIN_BLOCKS (infhip/methods/infinitehip/runtime/planner.py) and OFFLOAD_BATCH_TOKENS
(runtime/offload/policy.py). Llama-3.1-8B shapes (32 q / 8 kv heads, d 128, bf16, page 16, 32
layers), random keys and values, preset 3k's stages; one device call, a few minutes (most of it
Triton compiling).

    python -m benchmarks.speed.bench_constants --out $OUT                 # on the H200
    python -m benchmarks.speed.bench_constants --out /tmp/c --smoke       # tiny shapes on the CPU
                                                                    # (TRITON_INTERPRET=1): the code only

1. RAW_KEYS_MIN_BLOCKS. Past the trained window (dynamic RoPE) a prefill step prunes either from
   keys rotated on the fly, every query block re-rotating each key it loads, or from raw keys:
   one un-rotation pass over the context's keys (plugins/infinitehip/raw_keys.py), which every
   block then reads. For a chunk of NB query blocks of 64 (NB x 64 new tokens at the end of a
   context of N keys, N past Llama's 128K window) it times the 3k stages (query strides 4, 4, 1;
   the sparse attention after them is the same either way, not timed) rotating, and un-rotate +
   the same stages from raw keys, for NB in --blocks and N in --contexts. The constant is the
   smallest NB from which raw keys are no slower at every N (the runtime uses one number).
2. OFFLOAD_BATCH_TOKENS. With KV offloading a request's pages move to pinned host memory once
   OFFLOAD_BATCH_TOKENS / 16 pages are eligible: in decode one move every that many steps, of
   that many pages in each of the 32 full-attention layers (copy_pages, GPU -> host), after its
   page lists went to the GPU. For each batch it times the GPU copies (CUDA events) and the host
   side (the two index uploads and 64 launches, wall clock), per move and amortized per decode
   step, as a share of a decode step (--step-ms: 3k-flash offloaded at 512K, 7.26 ms,
   docs/benchmarks.md "KV offload"), bf16 and fp8 caches. The constant is the smallest batch
   whose amortized cost stays under --budget (1 %) of a step; the price of a larger one is up to
   batch - 1 pages per request and layer left on the GPU (printed).

Prints both tables and the two values the measurements pick beside the code's; JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch


GPU = dict(hq=32, hkv=8, d=128, page=16, layers=32, contexts="192k,1m", blocks="1,2,4,8,16,32,64,128",
           batches="16,32,64,128,256,512,1024,4096")
SMOKE = dict(hq=4, hkv=2, d=32, page=16, layers=2, contexts="3000", blocks="1,2,4", batches="16,64")
SMOKE_STAGES = dict(n_sink=16, n_stream=64, stages=[(64, 32, 512), (64, 8, 256), (64, 4, 128)],
                    special_final_k=128)


def parse_len(s: str) -> int:
    s = s.strip().lower()
    mult = {"k": 1024, "m": 1024 * 1024}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "km" else s) * mult)


def ints(spec: str) -> list[int]:
    return [parse_len(x) for x in spec.split(",") if x.strip()]


def time_ms(fn, reps: int = 3) -> float:
    """Median ms of one fn() call after a warm-up: CUDA events on a GPU, wall clock on the CPU."""
    from benchmarks.speed import timing
    return timing.event_ms(fn, reps)


class Context:
    """N random keys/values of one layer, pages in random order (one sequence)."""

    def __init__(self, n: int, shape: dict, dev: str, gen: torch.Generator, dtype=torch.bfloat16):
        page, hkv, d = shape["page"], shape["hkv"], shape["d"]
        pages = math.ceil(n / page) + 1
        self.n = n
        self.k_cache = torch.randn(pages, page, hkv, d, device=dev, generator=gen).to(dtype)
        perm = torch.randperm(pages - 1, device=dev, generator=gen) + 1  # page 0 = the null page
        self.table = perm[:math.ceil(n / page)].to(torch.int32)[None, :].contiguous()
        self.inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
        from infhip.plugins.paged_kv import PagedKV
        self.paged = PagedKV(self.k_cache, None)  # keys only: what the pruning launchers read


def raw_keys_threshold(args, shape: dict, dev: str, gen) -> dict:
    from infhip.methods.infinitehip import infinitehip_config
    from infhip.plugins.infinitehip import plan_query_blocks, pruning_stage, unrotate_keys

    cfg = infinitehip_config("3k", SMOKE_STAGES if args.smoke else None)
    bq, res = cfg.block_q, {}
    for n in ints(args.contexts):
        ctx = Context(n, shape, dev, gen)
        middle = max(0, n - cfg.n_stream - cfg.n_sink)
        rows = res[n] = {}
        for nb in ints(args.blocks):
            chunk = min(nb * bq, n)
            q = torch.randn(chunk, shape["hq"], shape["d"], device=dev, generator=gen).to(torch.bfloat16)
            starts, lens, ends, seq = plan_query_blocks([chunk], [n], bq, device=dev)
            tables = ctx.table.expand(starts.shape[0], -1).contiguous()
            kw = dict(n_sink=cfg.n_sink, n_stream=cfg.n_stream, inv_freq=ctx.inv_freq, block_q=bq,
                      rope_style=cfg.pruning_rope)

            def stages(raw=None):
                prev = (None, None)
                for i, st in enumerate(cfg.stages):
                    prev = pruning_stage(q, ctx.paged, tables, starts, lens, ends, *prev, chunk_size=st.chunk_size,
                                         k=st.k, max_candidates=middle if i == 0 else None,
                                         query_stride=cfg.query_strides[i], raw_keys=raw, **kw)

            def with_raw_keys():
                stages(unrotate_keys(ctx.paged, ctx.table, [n], ctx.inv_freq, seq.long()))

            rotating, raw = time_ms(stages), time_ms(with_raw_keys)
            rows[nb] = {"rotating_ms": rotating, "raw_keys_ms": raw, "raw_over_rotating": raw / rotating}
            print(f"[raw keys] {n:>8} keys, {nb:>4} blocks: rotating {rotating:8.2f} ms, "
                  f"unrotate + raw keys {raw:8.2f} ms ({raw / rotating:.2f}x)", flush=True)
        del ctx
        if dev == "cuda":
            torch.cuda.empty_cache()
    blocks = ints(args.blocks)
    # the smallest NB from which raw keys are no slower at every context, for every larger NB too
    pick = next((nb for i, nb in enumerate(blocks)
                 if all(res[n][b]["raw_over_rotating"] <= 1.0 for n in res for b in blocks[i:])), None)
    return {"per_context": res, "raw_keys_min_blocks": pick}


def offload_batch(args, shape: dict, dev: str, gen) -> dict:
    from infhip.plugins.kv_offload import HostKV, copy_pages
    from infhip.plugins.paged_kv import PagedKV

    page, layers, res = shape["page"], shape["layers"], {}
    batches = ints(args.batches)
    max_pages = max(batches) // page
    for kv in ("bf16", "fp8"):
        fp8 = kv == "fp8"
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        # per layer: a GPU cache and its host twin of max_pages + 1 pages (what one move touches)
        caches = []
        for _ in range(layers):
            k = torch.randn(max_pages + 1, page, shape["hkv"], shape["d"], device=dev, generator=gen).to(dtype)
            v = torch.randn(max_pages + 1, page, shape["hkv"], shape["d"], device=dev, generator=gen).to(dtype)
            ks = vs = None
            if fp8:
                ks = torch.rand(max_pages + 1, page, shape["hkv"], device=dev, generator=gen)
                vs = torch.rand(max_pages + 1, page, shape["hkv"], device=dev, generator=gen)
            caches.append((k, v, ks, vs, HostKV.like(k, max_pages)))
        page_bytes = sum(t[1:].numel() * t.element_size() for t in caches[0][:4] if t is not None) // max_pages
        rows = res[kv] = {}
        for tokens in batches:
            n = tokens // page
            src_list, dst_list = list(range(1, n + 1)), [-1 - i for i in range(n)]  # GPU pages -> host pages

            def move():  # the runner's part of a move: page lists to the GPU, one copy per layer
                src = torch.tensor(src_list, dtype=torch.int32, device=dev)
                dst = torch.tensor(dst_list, dtype=torch.int32, device=dev)
                for k, v, ks, vs, host in caches:
                    copy_pages(PagedKV(k, v, ks, vs, host), src, dst)

            gpu_ms = time_ms(move)
            host = []
            for _ in range(5):  # wall clock of the enqueueing alone (the GPU drained before each)
                if dev == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                move()
                host.append((time.perf_counter() - t) * 1e3)
            host_ms = statistics.median(host)
            per_step_ms = (gpu_ms + host_ms) / tokens  # one move per `tokens` decode steps
            rows[tokens] = {"pages": n, "gpu_ms": gpu_ms, "host_ms": host_ms, "per_step_ms": per_step_ms,
                            "share_of_step": per_step_ms / args.step_ms,
                            "gpu_bytes_held_per_request": (n - 1) * page_bytes * layers}
            print(f"[offload {kv}] batch {tokens:>5} tokens ({n:>4} pages x {layers} layers): GPU {gpu_ms:7.3f} ms, "
                  f"host {host_ms:7.3f} ms per move; {per_step_ms * 1e3:7.2f} µs per decode step "
                  f"({100 * per_step_ms / args.step_ms:.2f} % of {args.step_ms} ms); up to "
                  f"{(n - 1) * page_bytes * layers / 2**20:.1f} MiB more on the GPU per request", flush=True)
        del caches
        if dev == "cuda":
            torch.cuda.empty_cache()
    pick = next((t for t in batches if all(res[kv][t]["share_of_step"] <= args.budget for kv in res)), None)
    return {"per_kv_dtype": res, "offload_batch_tokens": pick, "step_ms": args.step_ms, "budget": args.budget}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--contexts", default=None, help="raw keys: context lengths (default 192k,1m)")
    ap.add_argument("--blocks", default=None, help="raw keys: query blocks per step (default 1,2,...,128)")
    ap.add_argument("--batches", default=None, help="offload: batch sizes in tokens (default 16,...,4096)")
    ap.add_argument("--step-ms", type=float, default=7.26, help="a decode step to compare with (ms)")
    ap.add_argument("--budget", type=float, default=0.01, help="offload: largest share of a step to spend")
    ap.add_argument("--skip", choices=("raw-keys", "offload"), action="append", default=[])
    args = ap.parse_args(argv)
    shape = SMOKE if args.smoke else GPU
    for key in ("contexts", "blocks", "batches"):
        if getattr(args, key) is None:
            setattr(args, key, shape[key])
    dev = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if dev == "cpu" and not args.smoke:
        raise SystemExit("bench_constants: no GPU; --smoke runs tiny shapes on the CPU (TRITON_INTERPRET=1)")
    args.out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=dev).manual_seed(0)
    import triton
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
           "triton": triton.__version__, "shape": shape, "smoke": args.smoke}
    t0 = time.perf_counter()
    if "raw-keys" not in args.skip:
        res["raw_keys"] = raw_keys_threshold(args, shape, dev, gen)
    if "offload" not in args.skip:
        res["offload"] = offload_batch(args, shape, dev, gen)
    res["total_s"] = time.perf_counter() - t0
    (args.out / "bench_constants.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    if "raw_keys" in res:
        print("\n| keys | query blocks | rotating ms | unrotate + raw keys ms | ratio |\n|---|---|---|---|---|")
        for n, rows in res["raw_keys"]["per_context"].items():
            for nb, r in rows.items():
                print(f"| {n} | {nb} | {r['rotating_ms']:.2f} | {r['raw_keys_ms']:.2f} | {r['raw_over_rotating']:.2f} |")
        from infhip.methods.infinitehip.runtime.planner import RAW_KEYS_MIN_BLOCKS
        print(f"RAW_KEYS_MIN_BLOCKS by this run: {res['raw_keys']['raw_keys_min_blocks']} (the code's: {RAW_KEYS_MIN_BLOCKS})")
    if "offload" in res:
        print("\n| KV | batch tokens | GPU ms / move | host ms / move | µs per decode step | share of a step |\n"
              "|---|---|---|---|---|---|")
        for kv, rows in res["offload"]["per_kv_dtype"].items():
            for t, r in rows.items():
                print(f"| {kv} | {t} | {r['gpu_ms']:.3f} | {r['host_ms']:.3f} | {r['per_step_ms'] * 1e3:.2f} | "
                      f"{100 * r['share_of_step']:.2f} % |")
        from infhip.runtime.offload.policy import OFFLOAD_BATCH_TOKENS
        print(f"OFFLOAD_BATCH_TOKENS by this run: {res['offload']['offload_batch_tokens']} (the code's: {OFFLOAD_BATCH_TOKENS})")
    print(f"total {res['total_s']:.0f} s")


if __name__ == "__main__":
    main()
