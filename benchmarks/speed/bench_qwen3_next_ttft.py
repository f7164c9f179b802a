"""Qwen3-Next (3:1 linear/full-attention hybrid, 512-expert MoE): time to first token, dense vs
token drop (UniPrefill), random weights at the 80B-A3B layer shapes cut in depth; and its MoE
layer, fused expert kernels vs the per-expert loop, in the same run.

    python -m benchmarks.speed.bench_qwen3_next_ttft --out $OUT --layers 12 --lengths 32k,128k   # one GPU
    python -m benchmarks.speed.bench_qwen3_next_ttft --out /tmp/x --smoke                       # tiny, CPU

Shapes: builder/model_configs/qwen3-next-80b-a3b.json with num_hidden_layers = --layers (a
multiple of 4: the 3:1 pattern kept, full attention at every 4th layer). One layer is ~3.3 GB in
bf16 (512 experts of 3 x 512 x 2048), so 12 layers (40 GB of weights, written once to --work)
fit an H100's memory and the machine's 64 GiB disk; the output records which layers ran. Token
drop's drop layers are placed by depth fraction among the full-attention layers, as on the whole
model (TokenDropConfig drop_layers "auto"), with a forced retention rho (random weights give no
meaningful attention: bench_token_drop.py says why); rho = 1 times the machinery's overhead.
TTFT = wall time of ``generate(max_tokens=1)``, device synchronised, best of --reps (one rep
above 64K tokens). The MoE rows: one MoE layer's experts on T random rows (T = 1 and 16: decode
batches; 4096: a prefill chunk), fused (plugins/moe.py experts_triton) and the per-expert loop
(experts_ref), each the best of --reps. JSON to --out/bench_qwen3_next_ttft.json.

--smoke: hidden 64, 8 layers, 8 experts, 64 tokens, rho 0.3, float32 on the CPU (the MoE rows
through the reference only): the test's run (tests/test_qwen3_next_token_drop.py).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.speed.bench_token_drop import parse_len

MODEL = "qwen3-next-80b-a3b"
SMOKE_SHAPES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=48, vocab_size=300)
SMOKE_KNOBS = dict(obs_window=8, block_size=8, num_sink=8)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/infhip-bench-qwen3-next"), help="the engine is built here")
    p.add_argument("--layers", type=int, default=12, help="a multiple of 4 (default 12: 3 full-attention layers)")
    p.add_argument("--lengths", default="32k,128k")
    p.add_argument("--retention", default="1,0.3", help="forced retention ratios rho of the token-drop runs")
    p.add_argument("--moe-tokens", default="1,16,4096", help="rows of the MoE-layer timings")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (the test's run)")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.lengths, args.retention, args.moe_tokens, args.reps = 8, "64", "0.3", "1,16", 1
    if args.layers <= 0 or args.layers % 4:
        raise SystemExit(f"bench_qwen3_next_ttft: --layers must be a positive multiple of 4, got {args.layers}")
    args.lengths = [parse_len(x) for x in args.lengths.split(",") if x.strip()]
    args.retention = [float(x) for x in args.retention.split(",") if x.strip()]
    args.moe_tokens = [int(x) for x in args.moe_tokens.split(",") if x.strip()]
    return args


def build(args) -> Path:
    """The random-weight engine (bf16 on the GPU, float32 on the CPU for --smoke), token drop's
    kernels in it."""
    from infhip.builder.build import build_engine
    from infhip.builder.registry import bundled_config

    cfg = json.loads(bundled_config(MODEL).read_text())
    cfg["num_hidden_layers"] = args.layers
    cfg.pop("layer_types", None)  # re-derived: full attention at every 4th layer
    if args.smoke:
        cfg.update(SMOKE_SHAPES)
    src = args.work / "config.json"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text(json.dumps(cfg))
    gpu = not args.smoke
    return build_engine(checkpoint=src, output_dir=args.work / "engine", dtype="bfloat16" if gpu else "float32",
                        device="cuda" if gpu else "cpu", random_weights=True, max_seq_len=max(args.lengths) + 8,
                        max_batch_size=1, force=True, progress=False, token_drop=True)


def _sync():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def best_of(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        best = min(best, time.perf_counter() - t)
    return best


def time_ttft(args, engine: Path, res: dict) -> None:
    import torch

    from infhip import LLM, SamplingParams
    from infhip.eval.common import set_forced_retention
    from infhip.methods.token_drop import TokenDropConfig

    llm = LLM(str(engine), max_num_seqs=1, enforce_eager=True, prefix_caching=False,
              kv_cache_memory_bytes=(8 << 30) if not args.smoke else None)
    cfg = llm.engine.config
    knobs = SMOKE_KNOBS if args.smoke else {}
    columns = [("dense", None, None)] + [(f"rho={r:g}", TokenDropConfig(min_prompt_len=0, **knobs), r)
                                         for r in args.retention]
    res["layer_types"] = list(cfg.model.layer_types)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    vocab = cfg.model.vocab_size
    for length in args.lengths:
        ids = torch.randint(10, vocab, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        row = {"length": length}
        for name, drop_config, rho in columns:
            llm.runner.set_transform("token_drop", drop_config)
            set_forced_retention(llm, rho)
            llm.generate(prompt_token_ids=[ids[:16]], sampling_params=sp)  # the path's kernels loaded
            row[name] = best_of(lambda: llm.generate(prompt_token_ids=[ids], sampling_params=sp),
                                1 if length > 65536 else args.reps)
            print(f"  {length:>7} tokens {name:>8}: TTFT {row[name] * 1e3:9.1f} ms", flush=True)
        res["drop_layers"] = sorted(llm.runner.transforms["token_drop"].drop_at)
        res["ttft"].append(row)


def time_moe(args, engine: Path, res: dict) -> None:
    """One MoE layer's experts, fused vs the per-expert loop, on random rows and routing."""
    import torch

    from infhip.config import EngineConfig
    from infhip.plugins.moe import experts_ref, experts_triton, route

    m = EngineConfig.load(engine).model
    moe, h = m.moe, m.hidden_size
    dev, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up = torch.randn(moe.num_experts, 2 * moe.intermediate_size, h, device=dev, dtype=dtype, generator=g) * 0.02
    down = torch.randn(moe.num_experts, h, moe.intermediate_size, device=dev, dtype=dtype, generator=g) * 0.02
    router = torch.randn(moe.num_experts, h, device=dev, dtype=dtype, generator=g)
    for t in args.moe_tokens:
        x = torch.randn(t, h, device=dev, dtype=dtype, generator=g)
        w, ids = route(x, router, moe.top_k, moe.norm_topk_prob)
        row = {"tokens": t, "loop_s": best_of(lambda: experts_ref(x, gate_up, down, w, ids), args.reps)}
        if not args.smoke:
            row["fused_s"] = best_of(lambda: experts_triton(x, gate_up, down, w, ids), args.reps)
        res["moe"].append(row)
        print(f"  MoE {t:>5} rows: loop {row['loop_s'] * 1e3:8.2f} ms"
              + (f", fused {row['fused_s'] * 1e3:8.2f} ms" if "fused_s" in row else ""), flush=True)


def main(argv=None) -> dict:
    import torch

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    res = {"model": MODEL, "layers": args.layers, "smoke": args.smoke, "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu",
           "retention": args.retention, "ttft": [], "moe": []}
    t0 = time.perf_counter()
    engine = build(args)
    res["build_s"] = time.perf_counter() - t0
    time_ttft(args, engine, res)
    time_moe(args, engine, res)
    (args.out / "bench_qwen3_next_ttft.json").write_text(json.dumps(res, indent=1) + "\n")
    print("\n| tokens | dense TTFT (ms) | " + " | ".join(f"rho={r:g} speedup" for r in args.retention) + " |")
    for row in res["ttft"]:
        print(f"| {row['length']} | {row['dense'] * 1e3:.1f} | "
              + " | ".join(f"{row['dense'] / row[f'rho={r:g}']:.2f}x" for r in args.retention) + " |")
    return res


if __name__ == "__main__":
    main()
