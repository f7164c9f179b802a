"""Probe (issue 22): does an fp8 x fp8 tensor-core kernel beat the weight-only fp8 GEMV at decode?

The weight-only GEMV (plugins/fp8_skinny_gemm.py) streams 2.2-3.6 TB/s where bf16 cuBLAS streams
4.2 (docs/fp8_weights.md "Speed"): every fp8 weight is converted to float in registers, and the
sweep of tile shapes found nothing faster. This probe removes the conversion: the activation rows
are quantized to e4m3 inside the kernel, one scale per (row, K tile) as in block-wise W8A8 schemes,
and the tile product runs on the fp8 tensor cores "swapped" (y^T = W x^T: the weight rows fill
the MMA's wide dimension, the <= 16 activation rows its narrow one), so no separate
quantization launch and no conversion of the weight:

    y[m, n] = scale_w[n] * sum_t s[m, t] * sum_{k in tile t} float(w[n, k]) * float(xq[m, k])
    s[m, t] = max(amax_{k in t} |x[m, k]|, 1e-30) / 448,   xq[m, k] = e4m3(x[m, k] / s[m, t])

This changes decode numerics from weight-only to W8A8 (the prefill path, torch._scaled_mm, already
quantizes activations per token), so it would only be adopted with a quality check on a real model.

    python benchmarks/fp8_tc_gemv_probe.py --smoke          # CPU, TRITON_INTERPRET=1: kernel == reference
    python benchmarks/fp8_tc_gemv_probe.py --out $OUT       # H200: timing table against the GEMV and cuBLAS
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from infhip.plugins._triton_utils import interpreted
from infhip.plugins.kv_quant import _round_to_e4m3

FP8 = torch.float8_e4m3fn
ROWS = 16  # the MMA's narrow dimension: activation rows padded to 16


@triton.jit
def _tc_kernel(x_ptr, w_ptr, scale_ptr, y_ptr, M, N, K, stride_xm, k_per_split,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, DOT_F32: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    m = tl.arange(0, 16)
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None] * K  # [BLOCK_N, 1]
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm  # [16, 1]
    m_mask = m[:, None] < M
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        k = k0 + ks
        w = tl.load(w_rows + k[None, :])  # [BLOCK_N, BLOCK_K] fp8 (K a multiple of BLOCK_K * SPLIT_K)
        x = tl.load(x_rows + k[None, :], mask=m_mask, other=0.0).to(tl.float32)  # [16, BLOCK_K]
        s = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-30) / 448.0  # [16]
        xq = _round_to_e4m3(tl.minimum(tl.maximum(x / s[:, None], -448.0), 448.0))
        if DOT_F32:  # the interpreter: exact float32 products of the same e4m3 values
            part = tl.dot(w.to(tl.float32), tl.trans(xq), input_precision="ieee")
        else:
            part = tl.dot(w, tl.trans(xq.to(tl.float8e4nv)))  # [BLOCK_N, 16] on the fp8 tensor cores
        acc += part * s[None, :]
    acc = acc * tl.load(scale_ptr + n, mask=n < N, other=0.0)[:, None]
    out = y_ptr + split.to(tl.int64) * M * N + m[None, :] * N + n[:, None]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(m[None, :] < M) & (n[:, None] < N))


def tc_gemv(x, w, scale, block_n: int, block_k: int, warps: int, stages: int, split: int = 1):
    """x [M <= 16, K] bf16, w [N, K] fp8, scale [N] float32 -> y [M, N] in x's dtype."""
    M, K = x.shape
    N = w.shape[0]
    assert M <= ROWS and K % (block_k * split) == 0, (M, K, block_k, split)
    y = torch.empty((split, M, N), dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    _tc_kernel[(triton.cdiv(N, block_n), split)](
        x, w, scale, y, M, N, K, x.stride(0), K // split, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
        DOT_F32=interpreted(x), num_warps=warps, num_stages=stages)
    return y[0] if split == 1 else y.sum(0).to(x.dtype)


def tc_ref(x, w, scale, block_k: int):
    """Plain torch: the same block-wise activation quantization, float64 products."""
    M, K = x.shape
    xt = x.double().view(M, K // block_k, block_k)
    s = (xt.abs().amax(-1).float().clamp_min(1e-30) / 448.0).double()  # [M, T], float32 as the kernel
    xq = (xt / s[..., None]).clamp(-448, 448).to(FP8).double()
    wt = w.double().view(w.shape[0], K // block_k, block_k)
    y = torch.einsum("mtk,ntk,mt->mn", xq, wt, s) * scale.double()[None, :]
    return y.to(x.dtype)


CONFIGS = [(bn, bk, wp, st, sp) for bn, bk, wp, st, sp in (
    (16, 256, 4, 4, 1), (16, 512, 4, 3, 1), (32, 256, 4, 4, 1), (32, 512, 4, 3, 1), (64, 256, 4, 4, 1),
    (64, 512, 4, 3, 1), (64, 128, 4, 6, 1), (128, 256, 4, 3, 1), (128, 128, 4, 5, 1), (64, 256, 4, 4, 2),
    (32, 512, 4, 3, 2), (128, 256, 8, 3, 2), (64, 256, 4, 4, 4))]


def smoke() -> None:
    torch.manual_seed(0)
    for M, N, K, cfg in ((1, 37, 512, (16, 256, 4, 1, 1)), (5, 70, 768, (32, 256, 4, 1, 1)),
                         (16, 33, 1024, (16, 256, 4, 1, 2))):
        x = torch.randn(M, K, dtype=torch.bfloat16)
        x[0, :256] *= 50  # a block with a different scale
        w32 = torch.randn(N, K) * 0.02
        s = w32.abs().amax(1).clamp_min(1e-30) / 448
        w = (w32 / s[:, None]).to(FP8)
        y = tc_gemv(x, w, s, *cfg)
        ref = tc_ref(x, w, s, cfg[1])
        err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
        print(f"M={M} N={N} K={K} cfg={cfg}: rel err vs reference {err:.2e}")
        assert err < 1e-2, err
    print("smoke OK")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", type=Path)
    p.add_argument("--budget-s", type=float, default=150)
    args = p.parse_args()
    if args.smoke:
        return smoke()
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_fp8_weights import SHAPES, graph_us, rel, shape_weights
    from infhip.plugins.fp8_skinny_gemm import fp8_skinny_gemm_triton, table_config

    t0 = time.monotonic()
    res = {}
    for name, (N, K) in SHAPES.items():
        wb, wq = shape_weights(N, K)
        for M in (1, 4, 16):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            exact = x.float() @ (wq[0][0].float() * wq[0][1][:, None]).t()
            table = table_config(M, N, K)
            row = {"bf16_cublas": graph_us(lambda w: F.linear(x, w), wb),
                   "table": graph_us(lambda w: fp8_skinny_gemm_triton(x, w[0], w[1], None, table), wq)}
            err = {"table": rel(fp8_skinny_gemm_triton(x, *wq[0], None, table), exact)}
            for cfg in CONFIGS:
                if time.monotonic() - t0 > args.budget_s or K % (cfg[1] * cfg[4]):
                    continue
                key = "tc_n{}_k{}_w{}_s{}_split{}".format(*cfg)
                try:
                    err[key] = rel(tc_gemv(x, *wq[0], *cfg), exact)
                    row[key] = graph_us(lambda w, c=cfg: tc_gemv(x, w[0], w[1], *c), wq)
                except Exception as e:
                    err[key] = f"{type(e).__name__}: {str(e)[:200]}"
            tcs = {k: v for k, v in row.items() if k.startswith("tc_")}
            best = min(tcs, key=tcs.get) if tcs else None
            res[f"{name}_M{M}"] = {"us": row, "rel_err": err}
            print(f"{name:8s} M={M:2d} bf16 {row['bf16_cublas']:6.1f} | GEMV table {row['table']:6.1f} "
                  f"({N * K / row['table'] / 1e6:.2f} TB/s, err {err['table']:.1e}) | best tc "
                  + (f"{best} {tcs[best]:6.1f} ({N * K / tcs[best] / 1e6:.2f} TB/s, err {err[best]:.1e}) "
                     f"= {tcs[best] / row['table']:.2f}x of table" if best else "none"), flush=True)
        del wb, wq
        torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fp8_tc_gemv_probe.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
