"""FP8 weights vs bf16 on the GPU: the kernels per shape, then whole engines side by side.
Llama-3.1-8B shapes, random weights, one GPU (written for the H200: torch 2.11, Triton 3.6).

    python -m benchmarks.speed.bench_fp8_weights --out $OUT [--engines bf16,fp8,fp8-lm-head] [--deadline-s 430]

1. Kernels (plugins/fp8_skinny_gemm.py, plugins/fp8_linear.py) at y[M, N] = x[M, K] w[N, K]^T for
   qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336, lm_head 128256x4096:
   - decode, M in 1..16: bf16 F.linear (cuBLAS), the bf16 skinny kernel where its table picks
     one, every fp8 skinny config (CONFIGS), and the fp8 large-M path (per-token quantization +
     torch._scaled_mm, use_fast_accum off and on). Each time is the median per call in a CUDA
     graph of 20 calls cycling over weight copies of >= 3x the L2 (every call reads w from DRAM,
     as a decode step does; benchmarks/speed/bench_skinny_gemm.py's method). Every fp8 path is first
     checked against the float32 product of the dequantized weight. The fastest fp8 choice per
     (shape, M) is what plugins/fp8_skinny_gemm.table_config should become (TODO there).
   - prefill, M in 512, 4096, 32768: bf16 F.linear vs quantization + torch._scaled_mm, and the
     quantization alone (CUDA events, eager).
2. Engines, built with infhip-build's code (random weights, dense, bf16 activations, 40K max
   length, 16 sequences): bf16, fp8 weights, fp8 weights + fp8 LM head. Per engine: batch-1 and
   batch-16 decode tok/s at a 1K-token context (CUDA graphs, 8 steps per host sync; throughput
   from the difference of a 32- and a 160-token run), prefill tok/s of one 8K and one 32K prompt,
   the weight-bandwidth floor (weights read per token / 4.3 TB/s), and the last-token logits of a
   1K prompt against the bf16 engine's (relative L2: the fp8 rounding, ~a few %, not ~1).
A deadline skips what would not finish (noted in the output). JSON to --out; a table last.

    python -m benchmarks.speed.bench_fp8_weights --out $OUT --gemv-sweep [--sweep-budget-s 120]

--gemv-sweep times only M = 1, on the five shapes: bf16 F.linear (cuBLAS), the config
plugins/fp8_skinny_gemm.table_config launches now, and every GEMV_CANDIDATES entry (same CUDA
graph method; each checked against the float32 product first), then prints per shape µs, TB/s
(weight bytes / time) and the speed-up over the table's config, and writes
bench_fp8_gemv_sweep.json. `--smoke` runs that logic on the CPU (Triton interpreter, tiny
shapes, eager wall times that mean nothing) to check the script before a GPU session.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import time
from pathlib import Path

from benchmarks.speed import timing
import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
DECODE_MS = (1, 2, 4, 8, 16)
PREFILL_MS = (512, 4096, 32768)
CALLS = 20
ENGINES = {"bf16": dict(), "fp8": dict(weight_dtype="fp8"),
           "fp8-lm-head": dict(weight_dtype="fp8", quantize_lm_head=True)}
BANDWIDTH = 4.3e12  # copy bandwidth measured on the H200 (SPEC §7)
DEVICE = "cuda"  # (a CPU smoke run of this script's logic sets "cpu" and the sizes below small)
CONTEXT = 1024  # decode context
PREFILL_LENS = (8192, 32768)
KV_BYTES = 20 << 30


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def graph_us(fn, weights: list, replays: int = 10) -> float:
    cycle = itertools.cycle(weights)
    if DEVICE == "cpu":  # --smoke: one eager call, only to run the logic
        t = time.perf_counter()
        fn(next(cycle))
        return (time.perf_counter() - t) * 1e6
    return timing.graph_time_us(lambda: fn(next(cycle)), copies=CALLS, replays=replays)


def shape_weights(N: int, K: int) -> tuple[list, list]:
    """Random bf16 weights [N, K] and their fp8 (w, scale) twins, as many copies as make >= 3x the
    L2 in fp8 (every call then reads its weight from DRAM, as a decode step does)."""
    from infhip.plugins.fp8_linear import quantize_weight

    l2 = (getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) if DEVICE == "cuda" else 0) or 60 << 20
    g = torch.Generator(device=DEVICE).manual_seed(0)
    copies = max(1, math.ceil(3 * l2 / (N * K))) if DEVICE == "cuda" else 1
    wb = [torch.randn(N, K, device=DEVICE, generator=g, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    return wb, [quantize_weight(w) for w in wb]


def scaled_mm(x, w, s, fast_accum: bool):
    from infhip.plugins.fp8_linear import quantize_act_triton
    xq, xs = quantize_act_triton(x)
    return torch._scaled_mm(xq, w.t(), scale_a=xs[:, None], scale_b=s[None, :], out_dtype=torch.bfloat16,
                            use_fast_accum=fast_accum)


def kernels(res: dict, deadline: float) -> None:
    from infhip.plugins import skinny_gemm as sg
    from infhip.plugins.fp8_linear import quantize_act_triton
    from infhip.plugins.fp8_skinny_gemm import CONFIGS, fp8_skinny_gemm_triton, table_config

    out = res["kernels"] = {}
    for name, (N, K) in SHAPES.items():
        wb, wq = shape_weights(N, K)
        for M in DECODE_MS:
            if time.monotonic() > deadline:
                out[f"{name}_M{M}"] = {"skipped": "deadline"}
                continue
            x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
            exact = x.float() @ (wq[0][0].float() * wq[0][1][:, None]).t()
            row = {"bf16_cublas": graph_us(lambda w: F.linear(x, w), wb)}
            cfg = sg.table_config(M, N, K, torch.bfloat16)
            if cfg is not None:
                row["bf16_skinny_table"] = graph_us(lambda w: sg.skinny_gemm_triton(x, w, None, cfg), wb)
            errors = {}
            for c in CONFIGS:
                if not c.applies(M):
                    continue
                errors[str(c)] = rel(fp8_skinny_gemm_triton(x, *wq[0], None, c), exact)
                row[f"fp8_{c}"] = graph_us(lambda w, c=c: fp8_skinny_gemm_triton(x, w[0], w[1], None, c), wq)
            for fast in (False, True):
                errors[f"scaled_mm_fast{int(fast)}"] = rel(scaled_mm(x, *wq[0], fast), exact)
                row[f"fp8_scaled_mm_fast{int(fast)}"] = graph_us(lambda w, f=fast: scaled_mm(x, w[0], w[1], f), wq)
            row["fp8_quant_only"] = graph_us(lambda w: quantize_act_triton(x), wq)
            fp8 = {k: v for k, v in row.items() if k.startswith("fp8_") and k != "fp8_quant_only"}
            best = min(fp8, key=fp8.get)
            table = table_config(M, N, K)
            row.update(best=best, best_us=fp8[best], table=str(table or "scaled_mm"),
                       table_us=fp8.get(f"fp8_{table}" if table else "fp8_scaled_mm_fast0"),
                       kernel_rel_err=max(v for k, v in errors.items() if not k.startswith("scaled_mm")),
                       scaled_mm_rel_err=max(v for k, v in errors.items() if k.startswith("scaled_mm")), errors=errors)
            out[f"{name}_M{M}"] = row
            print(f"{name:8s} M={M:2d} bf16 {row['bf16_cublas']:7.1f} us | fp8 best {best} {fp8[best]:7.1f} us "
                  f"| table {row['table']} {row['table_us']:7.1f} | rel err kernel {row['kernel_rel_err']:.1e} "
                  f"scaled_mm {row['scaled_mm_rel_err']:.1e}", flush=True)
        for M in PREFILL_MS:
            if time.monotonic() > deadline or name == "lm_head":  # (prefill scores one row per prompt)
                continue
            x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
            w, (w8, s) = wb[0], wq[0]
            row = {"bf16_ms": timing.event_ms(lambda: F.linear(x, w)),
                   "fp8_ms": timing.event_ms(lambda: scaled_mm(x, w8, s, False)),
                   "fp8_fast_accum_ms": timing.event_ms(lambda: scaled_mm(x, w8, s, True)),
                   "quant_ms": timing.event_ms(lambda: quantize_act_triton(x))}
            row["tflops_bf16"] = 2 * M * N * K / row["bf16_ms"] / 1e9
            row["tflops_fp8"] = 2 * M * N * K / row["fp8_ms"] / 1e9
            out[f"{name}_prefill_M{M}"] = row
            print(f"{name:8s} M={M:5d} bf16 {row['bf16_ms']:.3f} ms | fp8 {row['fp8_ms']:.3f} ms "
                  f"(fast accum {row['fp8_fast_accum_ms']:.3f}, quant {row['quant_ms']:.3f})", flush=True)
            del x
        del wb, wq
        torch.cuda.empty_cache()


def gemv_sweep(res: dict, deadline: float) -> None:
    """M = 1 per shape: bf16 cuBLAS, table_config's config, every GEMV_CANDIDATES entry (a config
    that fails to compile or run costs only its own row; past the deadline only the first two)."""
    from infhip.plugins.fp8_skinny_gemm import GEMV_CANDIDATES, fp8_skinny_gemm_triton, table_config

    out = res["gemv_sweep"] = {}
    for name, (N, K) in SHAPES.items():
        wb, wq = shape_weights(N, K)
        x = torch.randn(1, K, device=DEVICE, dtype=torch.bfloat16)
        exact = x.float() @ (wq[0][0].float() * wq[0][1][:, None]).t()
        table = table_config(1, N, K)
        row = out[name] = {"n": N, "k": K, "table": str(table), "us": {}, "rel_err": {}, "failed": {}, "skipped": [],
                           "bf16_cublas_us": graph_us(lambda w: F.linear(x, w), wb)}
        for c in (table, *GEMV_CANDIDATES):
            if time.monotonic() > deadline and c is not table:  # (the baseline is timed on every shape)
                row["skipped"].append(str(c))
                continue
            try:
                row["rel_err"][str(c)] = rel(fp8_skinny_gemm_triton(x, *wq[0], None, c), exact)
                row["us"][str(c)] = graph_us(lambda w, c=c: fp8_skinny_gemm_triton(x, w[0], w[1], None, c), wq)
            except Exception as e:  # e.g. out of shared memory or registers at this tile size
                row["failed"][str(c)] = f"{type(e).__name__}: {e}"[:300]
        print_sweep_shape(name, row, flush=True)
        del wb, wq
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def print_sweep_shape(name: str, row: dict, flush: bool = False) -> None:
    """One shape's sweep, fastest first: µs, TB/s of weight bytes (fp8: N*K; bf16: 2*N*K), speed-up
    over the table's config; ERR marks a relative error above the kernel tests' 1e-2."""
    nk = row["n"] * row["k"]
    base = row["us"].get(row["table"])
    print(f"\n{name} [{row['n']} x {row['k']}], M = 1: bf16 cuBLAS {row['bf16_cublas_us']:.1f} us "
          f"({2 * nk / row['bf16_cublas_us'] / 1e6:.2f} TB/s); table {row['table']} "
          f"{base if base is None else round(base, 1)} us", flush=flush)
    for cfg, us in sorted(row["us"].items(), key=lambda kv: kv[1]):
        mark = " ERR %.1e" % row["rel_err"][cfg] if row["rel_err"][cfg] > 1e-2 else ""
        speedup = f"{base / us:5.2f}x" if base else "  -  "
        table = " (table)" if cfg == row["table"] else ""
        print(f"  {cfg:34s} {us:8.1f} us {nk / us / 1e6:6.2f} TB/s {speedup}{table}{mark}", flush=flush)
    for cfg, why in row["failed"].items():
        print(f"  {cfg:34s} failed: {why[:120]}", flush=flush)
    if row["skipped"]:
        print(f"  skipped (deadline): {len(row['skipped'])} configs", flush=flush)


def print_sweep_matrix(res: dict) -> None:
    """Every config (rows) x shape (columns): µs per call, * marks the table's config for that
    shape, ! a relative error above 1e-2, - not timed (failed or skipped)."""
    sweep = res["gemv_sweep"]
    configs = list(dict.fromkeys(c for row in sweep.values() for c in [*row["us"], *row["failed"], *row["skipped"]]))
    print("\nM = 1, us per call (* the table's config, ! rel err > 1e-2):")
    print(f"{'config':34s}" + "".join(f"{name:>10s}" for name in sweep))
    print(f"{'bf16 cuBLAS':34s}" + "".join(f"{row['bf16_cublas_us']:10.1f}" for row in sweep.values()))
    for c in configs:
        cells = []
        for row in sweep.values():
            us = row["us"].get(c)
            mark = ("*" if c == row["table"] else "") + ("!" if row["rel_err"].get(c, 0) > 1e-2 else "")
            cells.append(f"{us:9.1f}{mark or ' '}" if us is not None else f"{'-':>9s} ")
        print(f"{c:34s}" + "".join(f"{cell:>10s}" for cell in cells))


def print_sweep_summary(res: dict) -> None:
    """Best correct candidate per shape against the table and cuBLAS, and what a batch-1 decode
    step of Llama-8B would spend in these GEMVs (32 layers x qkv, o, gate_up, down + the LM head)."""
    print("\nM = 1 GEMV sweep summary (us; TB/s of weight bytes):")
    print("| shape | bf16 cuBLAS | table (config) | best candidate (config) | best / table |")
    print("|---|---:|---:|---:|---:|")
    step = {"table": 0.0, "best": 0.0}
    for name, row in res["gemv_sweep"].items():
        ok = {c: us for c, us in row["us"].items() if row["rel_err"][c] <= 1e-2}
        base = row["us"].get(row["table"])
        if not ok or base is None:
            print(f"| {name} | {row['bf16_cublas_us']:.1f} | - | - | - |")
            continue
        best = min(ok, key=ok.get)
        nk = row["n"] * row["k"]
        print(f"| {name} | {row['bf16_cublas_us']:.1f} | {base:.1f} ({nk / base / 1e6:.2f}) {row['table']} | "
              f"{ok[best]:.1f} ({nk / ok[best] / 1e6:.2f}) {best} | {ok[best] / base:.2f} |")
        times = 1 if name == "lm_head" else 32
        step["table"] += times * base
        step["best"] += times * ok[best]
    print(f"GEMVs of one batch-1 decode step (32 layers + fp8 LM head): table {step['table'] / 1e3:.2f} ms, "
          f"best per shape {step['best'] / 1e3:.2f} ms")


def random_ids(llm, n: int, seed: int) -> list[int]:
    vocab = llm.engine.config.model.vocab_size
    return torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_tok_s(llm, batch: int, n1: int = 32, n2: int = 160) -> float:
    from infhip import SamplingParams
    ids = [random_ids(llm, CONTEXT, i) for i in range(batch)]

    def run(n):
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return timing.sync_time(lambda: llm.generate(prompt_token_ids=ids, sampling_params=sp))
    run(n1)  # warm-up
    t1, t2 = run(n1), run(n2)
    return batch * (n2 - n1) / (t2 - t1)


def last_logits(llm, ids: list[int]) -> torch.Tensor:
    from infhip import SamplingParams
    from infhip.runtime.sequence import Sequence
    seq = Sequence(seq_id=99_999, prompt_token_ids=ids, params=SamplingParams(max_tokens=1))
    llm.scheduler.add(seq)
    logits = llm.runner.execute(llm.scheduler.schedule())[0].float().cpu()
    llm.scheduler.finish(seq, "abort")
    return logits


def engine(name: str, flags: dict, work: Path, res: dict, ref_logits: dict) -> None:
    from infhip import LLM, SamplingParams
    from infhip.builder.build import build_engine
    from infhip.builder.registry import bundled_config

    src = work / "llama-3.1-8b.json"
    src.write_text(bundled_config("llama-3.1-8b").read_text())
    t = time.perf_counter()
    path = build_engine(checkpoint=src, output_dir=work / name, dtype="bfloat16", device=DEVICE, random_weights=True,
                        max_seq_len=40960, max_batch_size=16, force=True, progress=False, **flags)
    row = res["engines"][name] = {"build_s": round(time.perf_counter() - t, 1)}
    row["kernels"] = json.loads((path / "build_report.json").read_text())["kernels"]["count"]
    llm = LLM(path, kv_cache_memory_bytes=KV_BYTES, prefix_caching=False)
    model = llm.engine.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    read = weights - embed.numel() * embed.element_size() * (0 if model.cfg.tie_word_embeddings else 1)
    row.update(weights_gib=weights / 2**30, floor_tok_s=BANDWIDTH / read, load=llm.load_report)
    logits = last_logits(llm, random_ids(llm, CONTEXT, 99))
    ref_logits.setdefault("bf16", logits)
    row["logits_rel_l2_vs_bf16"] = rel(logits, ref_logits["bf16"])
    row["decode_b1_tok_s"] = decode_tok_s(llm, 1)
    row["decode_b16_tok_s"] = decode_tok_s(llm, 16)
    print(f"{name}: decode b1 {row['decode_b1_tok_s']:.1f} tok/s (floor {row['floor_tok_s']:.0f}), "
          f"b16 {row['decode_b16_tok_s']:.1f}; logits vs bf16 {row['logits_rel_l2_vs_bf16']:.2e}", flush=True)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for n in PREFILL_LENS:
        prompt = random_ids(llm, n, n)
        llm.generate(prompt_token_ids=[prompt[:CONTEXT]], sampling_params=sp)
        t_best = min(timing.sync_time(lambda: llm.generate(prompt_token_ids=[prompt], sampling_params=sp)) for _ in range(2))
        row[f"prefill_{n}_tok_s"] = n / t_best
        print(f"{name}: prefill {n} {n / t_best:.0f} tok/s", flush=True)
    del llm, model, embed
    torch.cuda.empty_cache()
    shutil.rmtree(path, ignore_errors=True)


def print_tables(res: dict) -> None:
    print("\nkernels, us per call (decode M; CUDA graph, weights from DRAM): bf16 cuBLAS | bf16 table | "
          "fp8 best (config) | fp8 table now | fp8 scaled_mm")
    for key, r in res["kernels"].items():
        if "best" in r:
            print(f"  {key:14s} {r['bf16_cublas']:8.1f} | {r.get('bf16_skinny_table', float('nan')):8.1f} | "
                  f"{r['best_us']:8.1f} ({r['best'][4:]}) | {r['table_us']:8.1f} | {r['fp8_scaled_mm_fast0']:8.1f}")
    eng = res["engines"]
    names = [n for n in ENGINES if n in eng]
    print(f"\n{res['gpu']}  torch {res['torch']}  triton {res['triton']}; Llama-3.1-8B shapes, random weights, "
          f"dense, bf16 activations; ratios vs bf16 in the same run")
    print("| metric | " + " | ".join(names) + " | " + " | ".join(f"{n}/bf16" for n in names[1:]) + " |")
    print("|---" * (2 * len(names)) + "|")
    for key, label in (("decode_b1_tok_s", f"decode b=1 @{CONTEXT} tok/s (goal fp8 >= 400)"),
                       ("decode_b16_tok_s", f"decode b=16 @{CONTEXT} tok/s"),
                       *((f"prefill_{n}_tok_s", f"prefill {n} tok/s (goal >= 1.5x)") for n in PREFILL_LENS),
                       ("floor_tok_s", "weight floor tok/s @4.3 TB/s"), ("weights_gib", "weights GiB"),
                       ("logits_rel_l2_vs_bf16", "logits rel L2 vs bf16"), ("build_s", "build s")):
        vals = [eng[n].get(key) for n in names]
        cells = [("%.3g" % v if key.startswith("logits") else f"{v:.1f}") if v is not None else "-" for v in vals]
        base = vals[0] if names and names[0] == "bf16" else None
        ratios = [f"{v / base:.2f}" if v and base and not key.startswith(("logits", "build")) else "-" for v in vals[1:]]
        print(f"| {label} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    for note in res["notes"]:
        print("note:", note)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/infhip-fp8"))
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--deadline-s", type=float, default=430.0, help="stop starting work after this many seconds")
    p.add_argument("--kernel-budget-s", type=float, default=100.0)
    p.add_argument("--gemv-sweep", action="store_true", help="time only the M = 1 candidates (GEMV_CANDIDATES)")
    p.add_argument("--sweep-budget-s", type=float, default=120.0)
    p.add_argument("--smoke", action="store_true", help="--gemv-sweep's logic on the CPU, tiny shapes")
    args = p.parse_args()
    t0 = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    import triton
    if args.smoke:
        global DEVICE, SHAPES
        assert os.environ.get("TRITON_INTERPRET") == "1", "--smoke runs the kernels in the Triton interpreter"
        DEVICE, SHAPES = "cpu", {name: (n // 512 + 5, k // 256 + 12) for name, (n, k) in SHAPES.items()}
        args.gemv_sweep = True
    res = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)", "torch": torch.__version__,
           "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"), "engines": {}, "notes": []}
    if args.gemv_sweep:
        gemv_sweep(res, t0 + args.sweep_budget_s)
        res["total_s"] = round(time.monotonic() - t0, 1)
        (args.out / "bench_fp8_gemv_sweep.json").write_text(json.dumps(res, indent=1, default=str))
        print_sweep_matrix(res)
        print_sweep_summary(res)
        return
    kernels(res, t0 + args.kernel_budget_s)
    (args.out / "bench_fp8_weights.json").write_text(json.dumps(res, indent=1, default=str))
    ref_logits: dict = {}
    for name in args.engines.split(","):
        elapsed = time.monotonic() - t0
        if elapsed > args.deadline_s - 90:  # an engine takes ~60-90 s (build ~45 s)
            res["notes"].append(f"{name}: skipped at {elapsed:.0f} s (deadline {args.deadline_s:.0f} s)")
            continue
        try:
            engine(name, ENGINES[name], args.work, res, ref_logits)
        except Exception as e:  # one engine's failure must not cost the others' numbers
            res["engines"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            res["notes"].append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
        (args.out / "bench_fp8_weights.json").write_text(json.dumps(res, indent=1, default=str))
    res["total_s"] = round(time.monotonic() - t0, 1)
    (args.out / "bench_fp8_weights.json").write_text(json.dumps(res, indent=1, default=str))
    print_tables(res)


if __name__ == "__main__":
    main()
