"""FP8 weights vs bf16 on the GPU: the kernels per shape, then whole engines side by side.
Llama-3.1-8B shapes, random weights, one GPU (written for the H200: torch 2.11, Triton 3.6).

    python benchmarks/bench_fp8_weights.py --out $OUT [--engines bf16,fp8,fp8-lm-head] [--deadline-s 430]

1. Kernels (plugins/fp8_skinny_gemm.py, plugins/fp8_linear.py) at y[M, N] = x[M, K] w[N, K]^T for
   qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336, lm_head 128256x4096:
   - decode, M in 1..16: bf16 F.linear (cuBLAS), the bf16 skinny kernel where its table picks
     one, every fp8 skinny config (CONFIGS), and the fp8 large-M path (per-token quantization +
     torch._scaled_mm, use_fast_accum off and on). Each time is the median per call in a CUDA
     graph of 20 calls cycling over weight copies of >= 3x the L2 (every call reads w from DRAM,
     as a decode step does; benchmarks/bench_skinny_gemm.py's method). Every fp8 path is first
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
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import shutil
import time
from pathlib import Path

import timing
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
    return timing.graph_time_us(lambda: fn(next(cycle)), copies=CALLS, replays=replays)


def scaled_mm(x, w, s, fast_accum: bool):
    from infhip.plugins.fp8_linear import quantize_act_triton
    xq, xs = quantize_act_triton(x)
    return torch._scaled_mm(xq, w.t(), scale_a=xs[:, None], scale_b=s[None, :], out_dtype=torch.bfloat16,
                            use_fast_accum=fast_accum)


def kernels(res: dict, deadline: float) -> None:
    from infhip.plugins import skinny_gemm as sg
    from infhip.plugins.fp8_linear import quantize_act_triton, quantize_weight
    from infhip.plugins.fp8_skinny_gemm import CONFIGS, fp8_skinny_gemm_triton, table_config

    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 60 << 20
    out = res["kernels"] = {}
    for name, (N, K) in SHAPES.items():
        g = torch.Generator(device=DEVICE).manual_seed(0)
        copies = max(1, math.ceil(3 * l2 / (N * K)))  # of the fp8 weight (bf16: 2x the bytes)
        wb = [torch.randn(N, K, device=DEVICE, generator=g, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        wq = [quantize_weight(w) for w in wb]
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
    args = p.parse_args()
    t0 = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    import triton
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d"), "engines": {}, "notes": []}
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
