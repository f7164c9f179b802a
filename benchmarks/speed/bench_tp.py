"""Tensor parallelism: TP = 1 vs TP = N, random weights, bf16, N GPUs of one host.

    python -m benchmarks.speed.bench_tp --tp 2 --out $OUT            # Llama-3.1-8B shapes, >= 2 GPUs
    python -m benchmarks.speed.bench_tp --tp 2 --layers 8 --out $OUT  # quicker: 8 of the 32 layers
    python -m benchmarks.speed.bench_tp --tp 2 --model gemma-3-27b --prefill-lengths 32k,128k --out $OUT
    python -m benchmarks.speed.bench_tp --tp 2 --model gemma-3-27b --dry-run   # the plan, no GPU needed

1. Build two engines from the same random weights (``infhip-build --random-weights --device
   cuda``, seed 0): --tp 1 and --tp N (the same tensors, cut into N shards).
2. For each, in turn (the same process; the first is closed before the second loads):
   - greedy tokens of 4 prompts of 512 tokens, 64 tokens each (exactness: bf16, so the
     all-reduces' summation order may flip a near-tie; reported as the share of equal tokens
     and the first step where they differ);
   - decode tok/s at batch 1 and 16 (difference of two runs, prefill cancels; CUDA graphs, 8
     steps per host sync: the engine defaults);
   - prefill tok/s of one prompt per --prefill-lengths (default 8K: one chunk, and 32K);
   - all-reduce time per decode step at batch 1 and 16: GPU time of the NCCL kernels on rank 0
     over profiled decode steps (torch.profiler/CUPTI, the graphs' kernels included), divided
     by the steps: the 2 per layer all-reduces plus the sampled tokens' broadcast; it includes
     waiting for the slowest rank.
Prints a table last and writes JSON to --out/bench_tp.json. Needs nothing outside this repo.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

from benchmarks.speed import timing
import torch


PREFILL_LENGTHS = [8192, 32768]  # --prefill-lengths
MODELS = ("llama-3.1-8b", "gemma-3-27b")  # bundled configs (builder/model_configs)


def parse_lengths(text: str) -> list[int]:
    """'8k,32k,128k' -> [8192, 32768, 131072]."""
    return [int(x[:-1]) * 1024 if x.lower().endswith("k") else int(x) for x in text.split(",") if x]


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 100000, (length,), generator=g).tolist() for _ in range(n)]


def decode_tok_s(llm, SamplingParams, batch: int, n1: int = 32, n2: int = 160) -> float:
    ids = prompts(batch, 128, seed=1)

    def run(n):
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return timing.sync_time(lambda: llm.generate(prompt_token_ids=ids, sampling_params=sp))
    run(n1)  # warm-up
    return batch * (n2 - n1) / (run(n2) - run(n1))


def prefill_tok_s(llm, SamplingParams, length: int) -> float:
    ids = prompts(1, length, seed=2)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(prompt_token_ids=[ids[0][:1024]], sampling_params=sp)  # warm-up
    return length / timing.sync_time(lambda: llm.generate(prompt_token_ids=ids, sampling_params=sp))


def all_reduce_ms_per_step(llm, SamplingParams, batch: int, steps: int = 64) -> float:
    """NCCL kernel time on rank 0 per decode step (0.0 at TP = 1)."""
    from torch.profiler import ProfilerActivity, profile

    ids = prompts(batch, 128, seed=3)
    sp = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    llm.generate(prompt_token_ids=ids, sampling_params=sp)  # warm-up
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt_token_ids=ids, sampling_params=sp)
        torch.cuda.synchronize()
    us = sum(e.device_time_total for e in prof.key_averages() if "nccl" in e.key.lower())
    return us / 1e3 / steps


def measure(engine: Path, res: dict, tag: str) -> list[list[int]]:
    from infhip import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(engine, kv_cache_memory_bytes=16 << 30)
    res[f"{tag}_load_s"] = time.perf_counter() - t
    try:
        greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        tokens = [o.token_ids for o in llm.generate(prompt_token_ids=prompts(4, 512), sampling_params=greedy)]
        for b in (1, 16):
            res[f"{tag}_decode_b{b}_tok_s"] = decode_tok_s(llm, SamplingParams, b)
            res[f"{tag}_all_reduce_ms_per_step_b{b}"] = all_reduce_ms_per_step(llm, SamplingParams, b)
            print(f"{tag}: decode b={b} {res[f'{tag}_decode_b{b}_tok_s']:.1f} tok/s, all-reduce "
                  f"{res[f'{tag}_all_reduce_ms_per_step_b{b}']:.3f} ms/step", flush=True)
        for length in PREFILL_LENGTHS:
            res[f"{tag}_prefill_{length}_tok_s"] = prefill_tok_s(llm, SamplingParams, length)
            print(f"{tag}: prefill {length}: {res[f'{tag}_prefill_{length}_tok_s']:.0f} tok/s", flush=True)
        return tokens
    finally:
        llm.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2, help="tensor parallelism to compare with 1 (default 2)")
    ap.add_argument("--model", choices=MODELS, default="llama-3.1-8b", help="the bundled config whose shapes to build")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the model has (quicker builds)")
    ap.add_argument("--prefill-lengths", default="8k,32k", help="prompt lengths of the prefill rows, e.g. 32k,128k")
    ap.add_argument("--dry-run", action="store_true", help="print the engines' settings and exit (no GPU needed)")
    ap.add_argument("--out", type=Path, default=Path("bench_tp_out"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/infhip_bench_tp"))
    args = ap.parse_args()
    PREFILL_LENGTHS[:] = parse_lengths(args.prefill_lengths)
    # the longest prompt and its generated token, in whole KiB (a 128K prompt passes both models'
    # 131072-token window by a page: the build warns, as it should)
    max_seq_len = max(40960, -(-(max(PREFILL_LENGTHS) + 256) // 1024) * 1024)
    if args.dry_run:
        print(f"model {args.model} (layers {args.layers or 'all'}), TP 1 and {args.tp}, max_seq_len {max_seq_len}, "
              f"prefill {PREFILL_LENGTHS}, decode batch 1 and 16")
        return
    if torch.cuda.device_count() < args.tp:
        raise SystemExit(f"bench_tp: --tp {args.tp} needs {args.tp} GPUs, {torch.cuda.device_count()} visible")
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)

    from infhip.builder.build import build_engine
    from infhip.builder.registry import bundled_config

    cfg = json.loads(bundled_config(args.model).read_text())
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    (args.work / "hf").mkdir(exist_ok=True)
    (args.work / "hf" / "config.json").write_text(json.dumps(cfg))
    res: dict = {"model": args.model, "tp": args.tp, "layers": cfg["num_hidden_layers"],
                 "prefill_lengths": PREFILL_LENGTHS, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    engines = {}
    for tp in (1, args.tp):
        t = time.perf_counter()
        engines[tp] = build_engine(checkpoint=args.work / "hf" / "config.json", output_dir=args.work / f"tp{tp}",
                                   random_weights=True, dtype="bfloat16", device="cuda", max_seq_len=max_seq_len,
                                   max_batch_size=16, tp=tp, force=True, progress=False)
        res[f"tp{tp}_build_s"] = time.perf_counter() - t
        print(f"built tp {tp} in {res[f'tp{tp}_build_s']:.1f} s", flush=True)

    tokens = {tp: measure(engines[tp], res, f"tp{tp}") for tp in (1, args.tp)}
    a, b = tokens[1], tokens[args.tp]
    equal = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    res["greedy_equal_share"] = equal / sum(len(r) for r in a)
    res["greedy_first_divergence"] = [next((j for j, (x, y) in enumerate(zip(ra, rb)) if x != y), None)
                                      for ra, rb in zip(a, b)]
    (args.out / "bench_tp.json").write_text(json.dumps(res, indent=2) + "\n")

    n = args.tp
    print(f"\n| {args.model} shapes ({res['layers']} layers), bf16 | TP 1 | TP {n} | TP {n} / TP 1 |")
    print("|---|---|---|---|")
    prefill = tuple((f"prefill_{L}_tok_s", f"prefill {L // 1024}K (tok/s)") for L in PREFILL_LENGTHS)
    for key, label in (("decode_b1_tok_s", "decode b=1 (tok/s)"), ("decode_b16_tok_s", "decode b=16 (tok/s)"),
                       *prefill,
                       ("all_reduce_ms_per_step_b1", "all-reduce per decode step b=1 (ms)"),
                       ("all_reduce_ms_per_step_b16", "all-reduce per decode step b=16 (ms)"),
                       ("load_s", "LLM() (s)")):
        one, many = res[f"tp1_{key}"], res[f"tp{n}_{key}"]
        print(f"| {label} | {one:.3f} | {many:.3f} | {many / one if one else float('nan'):.2f} |")
    print(f"greedy tokens equal: {res['greedy_equal_share']:.3f}, first divergence per prompt: "
          f"{res['greedy_first_divergence']}")


if __name__ == "__main__":
    main()
