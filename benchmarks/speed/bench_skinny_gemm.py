"""Skinny GEMM (plugins/skinny_gemm.py) vs cuBLAS (F.linear) at Llama-3.1-8B decode shapes, bf16.

    python -m benchmarks.speed.bench_skinny_gemm --out $OUT

For every shape (y[M, N] = x[M, K] @ w[N, K]^T: qkv 6144x4096, o 4096x4096, gate_up 28672x4096,
down 4096x14336, lm_head 128256x4096) and M in {1, 2, 4, 8, 16}:
1. correctness: each Triton config against F.linear (relative L2 < 1e-2);
2. time: F.linear and each config, CUDA events around replays of a CUDA graph of 20 calls (no
   launch gaps), median of --replays replays / 20. The 20 calls cycle over copies of w that
   together hold >= 3x the L2 size, so every call reads its w from DRAM as a decode step does;
3. the dispatcher (`skinny_linear`, INFHIP_SKINNY_GEMM unset): what it chose per key, and its
   time in the same graph setting.
Prints per-config times at M=1, then the summary table (us, GB/s of w+x+y, speed-up vs cuBLAS)
and the per-token saving at M=1 over the 32 layers; writes JSON to --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
from pathlib import Path

from benchmarks.speed import timing
import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
CALLS = 20  # calls per graph
NUM_LAYERS = 32


def graph_us(fn, weights: list[torch.Tensor], replays: int) -> float:
    """Median per-call GPU time of fn(w) over a CUDA graph of CALLS calls cycling over weights."""
    cycle = itertools.cycle(weights)
    return timing.graph_time_us(lambda: fn(next(cycle)), copies=CALLS, replays=replays)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ms", default="1,2,4,8,16")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--replays", type=int, default=20)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.pop("INFHIP_SKINNY_GEMM", None)  # the dispatcher in its default (timed) mode
    import triton

    from infhip.plugins import skinny_gemm as sg

    dtype, dev = torch.bfloat16, torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 0) or 64 << 20
    res: dict = {"gpu": props.name, "torch": torch.__version__, "triton": triton.__version__,
                 "l2_bytes": l2, "configs": [str(c) for c in sg.CONFIGS], "rows": []}
    ms = [int(m) for m in args.ms.split(",")]
    sg.reset_skinny_gemm_decisions()
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w_bytes = n * k * dtype.itemsize
        copies = max(2, math.ceil(3 * l2 / w_bytes))
        weights = [torch.randn(n, k, device=dev, dtype=dtype) / k ** 0.5 for _ in range(copies)]
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            nbytes = w_bytes + (m * k + m * n) * dtype.itemsize
            ref = F.linear(x, weights[0])
            row = {"shape": name, "N": n, "K": k, "M": m, "bytes": nbytes, "weight_copies": copies,
                   "cublas_us": graph_us(lambda w: F.linear(x, w), weights, args.replays),
                   "configs": {}, "errors": {}}
            for cfg in sg.CONFIGS:
                if not cfg.applies(m):
                    continue
                try:
                    err = rel(sg.skinny_gemm_triton(x, weights[0], None, cfg), ref)
                    us = graph_us(lambda w, cfg=cfg: sg.skinny_gemm_triton(x, w, None, cfg), weights, args.replays)
                except Exception as exc:  # e.g. a config out of shared memory
                    row["errors"][str(cfg)] = f"{type(exc).__name__}: {exc}"[:200]
                    continue
                row["configs"][str(cfg)] = {"us": us, "rel_l2": err, "ok": err < 1e-2}
            best = min(row["configs"], key=lambda c: row["configs"][c]["us"], default=None)
            row["best"] = best
            row["best_us"] = row["configs"][best]["us"] if best else float("nan")
            row["dispatch_rel_l2"] = rel(sg.skinny_linear(x, weights[0]), ref)  # decides this key
            key = (sg.m_bucket(m), n, k, dtype, False, x.device.index)
            decision = sg.skinny_gemm_decisions().get(key)
            row["dispatch_choice"] = str(decision.config) if decision and decision.config else "cublas"
            row["dispatch_timings_us"] = decision.timings_us if decision else {}
            row["dispatch_us"] = graph_us(lambda w: sg.skinny_linear(x, w), weights, args.replays)
            res["rows"].append(row)
            print(f"{name} M={m}: cublas {row['cublas_us']:.1f} us, best {best} {row['best_us']:.1f} us, "
                  f"dispatch -> {row['dispatch_choice']}", flush=True)
        del weights
        torch.cuda.empty_cache()

    bad = [(r["shape"], r["M"], c) for r in res["rows"] for c, v in r["configs"].items() if not v["ok"]]
    bad += [(r["shape"], r["M"], "dispatch") for r in res["rows"] if not r["dispatch_rel_l2"] < 1e-2]
    res["correctness_failures"] = bad
    per_layer = [r for r in res["rows"] if r["M"] == 1 and r["shape"] in ("qkv", "o", "gate_up", "down")]
    res["m1_step_saving_us"] = NUM_LAYERS * sum(r["cublas_us"] - r["dispatch_us"] for r in per_layer)
    (args.out / "skinny_gemm.json").write_text(json.dumps(res, indent=1))

    gbs = lambda r, us: r["bytes"] / us / 1e3  # noqa: E731  bytes/us -> GB/s
    print("\nper config at M=1 (us; GB/s):")
    for r in (r for r in res["rows"] if r["M"] == 1):
        cells = "  ".join(f"{c}={v['us']:.1f}" for c, v in r["configs"].items())
        print(f"  {r['shape']:8s} cublas={r['cublas_us']:.1f}  {cells}")
        for c, e in r["errors"].items():
            print(f"    {c}: {e}")
    print(f"\n{'shape':8s} {'M':>3s} {'cublas us':>10s} {'GB/s':>6s} {'best config':22s} {'us':>7s} "
          f"{'GB/s':>6s} {'x cublas':>8s} {'dispatch':22s} {'us':>7s}")
    for r in res["rows"]:
        print(f"{r['shape']:8s} {r['M']:3d} {r['cublas_us']:10.1f} {gbs(r, r['cublas_us']):6.0f} "
              f"{str(r['best']):22s} {r['best_us']:7.1f} {gbs(r, r['best_us']):6.0f} "
              f"{r['cublas_us'] / r['best_us']:8.3f} {r['dispatch_choice']:22s} {r['dispatch_us']:7.1f}")
    print(f"\nM=1, {NUM_LAYERS} layers x (qkv, o, gate_up, down): dispatcher saves "
          f"{res['m1_step_saving_us']:.1f} us per decode step vs cuBLAS")
    print("correctness (rel L2 < 1e-2 vs F.linear):", "all ok" if not bad else f"FAILED {bad}")


if __name__ == "__main__":
    main()
