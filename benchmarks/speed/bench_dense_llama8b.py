"""Dense engine vs Hugging Face transformers, Llama-3.1-8B shapes, random weights, bf16, one GPU.

    python -m benchmarks.speed.bench_dense_llama8b --out $OUT

1. Random-init a transformers LlamaForCausalLM from the shipped llama-3.1-8b config, save it as a
   Hugging Face checkpoint, build an infhip engine from it (the real conversion path).
2. Logits of a 1K-token prompt: infhip vs transformers (both bf16), relative L2 error; both
   against a float32 transformers run, and transformers' eager attention against its SDPA (bf16).
3. Decode tokens/s at batch 1 and 16 (short context): infhip (CUDA graphs) vs transformers generate.
4. Prefill tokens/s at 8K and 32K: infhip vs transformers forward (SDPA, logits of the last token).
Prints a table last and writes JSON to --out.

`--smoke` (benchmarks/speed/tiny.py): steps 1-4 on the CPU with a tiny Llama in float32 (both
sides), prompts cut to 200 tokens, fewer decode tokens; the CUDA-only parts (the decode graph's
replay and kernel profile, the split sweep of the Triton decode kernel) are skipped and say so.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from benchmarks.speed import timing, tiny
import torch

FLOOR_NOTE = "weight-bandwidth floor: bytes of weights read per token / 4.3 TB/s"
DEVICE, DTYPE = "cuda", torch.bfloat16  # --smoke: "cpu", torch.float32


def profile_graph(graph, path: Path, reps: int = 10) -> dict:
    """Per-kernel GPU time of one graph replay (torch.profiler/CUPTI), grouped by kernel name."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / reps, e.count // reps) for e in prof.key_averages()
            if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    lines = [f"{us:10.1f} us {n:5d}x  {name[:100]}" for name, us, n in rows]
    total = sum(r[1] for r in rows)
    path.write_text(f"kernel time per replay: {total:.1f} us\n" + "\n".join(lines) + "\n")
    print(f"decode b=1 kernels: {total:.0f} us of GPU time per step; top:\n  " + "\n  ".join(lines[:8]), flush=True)
    return {"total_us": total, "top": rows[:12]}


def make_hf_checkpoint(path: Path, num_layers: int | None, smoke: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    from infhip.builder.registry import bundled_config
    cfg = tiny.tiny_config("llama-3.1-8b") if smoke else json.loads(bundled_config("llama-3.1-8b").read_text())
    if num_layers:
        cfg["num_hidden_layers"] = num_layers
    config = LlamaConfig(**cfg)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config).to(DTYPE)
    model.save_pretrained(path, safe_serialization=True)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    # Reload the way users do: from_pretrained keeps RoPE's inv_freq in float32 (a `.to(bf16)`
    # of a freshly built model would round it to bf16).
    return LlamaForCausalLM.from_pretrained(path, dtype=DTYPE, device_map=DEVICE).eval()


def decode_tok_s(llm, SamplingParams, batch: int, prompt_len: int = 128, n1: int = 32, n2: int = 160) -> float:
    """Decode throughput from the difference of two runs (prefill cost cancels)."""
    ids = [[(7 * i + j) % 300 + 10 for j in range(prompt_len)] for i in range(batch)]  # (300: the tiny vocab)

    def run(n):
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return timing.sync_time(lambda: llm.generate(prompt_token_ids=ids, sampling_params=sp))
    run(n1)  # warm-up
    t1, t2 = run(n1), run(n2)
    return batch * (n2 - n1) / (t2 - t1)


def hf_decode_tok_s(hf, batch: int, prompt_len: int = 128, n1: int = 8, n2: int = 40) -> float:
    ids = torch.randint(10, 300, (batch, prompt_len), device=DEVICE)

    def run(n):
        return timing.sync_time(lambda: hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False))
    run(n1)
    t1, t2 = run(n1), run(n2)
    return batch * (n2 - n1) / (t2 - t1)


def decode_split_sweep() -> dict:
    """Dense paged decode attention alone (Llama-8B heads, batch 1, bf16), split counts swept at
    short contexts, each with the length bound of its CUDA-graph bucket: which split rule wins."""
    from infhip.plugins.dense_attention import paged_decode_attention_triton
    from infhip.plugins.paged_kv import PagedKV
    page, hq, hkv, d = 16, 32, 8, 128
    res = {}
    for ctx, bound in ((300, 512), (1800, 2048), (7000, 8192)):
        pages = bound // page
        k = torch.randn(pages + 1, page, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        table = (torch.randperm(pages, device="cuda") + 1).to(torch.int32)[None]
        q = torch.randn(1, hq, d, device="cuda", dtype=torch.bfloat16)
        lens = torch.tensor([ctx], device="cuda", dtype=torch.int32)
        out = torch.empty_like(q)
        row = {}
        for splits in (None, 1, 2, 4, 8, 16, 32):
            row[str(splits or "default")] = timing.graph_time_us(lambda s=splits: paged_decode_attention_triton(
                q, PagedKV(k, v), table, lens, d ** -0.5, out=out, num_splits=s, max_len=bound), replays=20)
        res[ctx] = row
        print(f"decode attention, context {ctx} (bucket {bound}), us per layer by splits: "
              + ", ".join(f"{n}={t:.2f}" for n, t in row.items()), flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/infhip-bench"))
    p.add_argument("--num-layers", type=int, default=None, help="fewer layers for a quick smoke run")
    p.add_argument("--prefill-lens", default="8192,32768")
    p.add_argument("--smoke", action="store_true", help="a tiny Llama on the CPU: the code path, not speed")
    args = p.parse_args()
    global DEVICE, DTYPE
    if args.smoke:
        DEVICE, DTYPE = "cpu", torch.float32
    dt = str(DTYPE).removeprefix("torch.")
    n1, n2 = (4, 12) if args.smoke else (32, 160)  # decode_tok_s's two run lengths
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    from infhip import LLM, SamplingParams
    from infhip.builder.build import build_engine

    res: dict = {"gpu": tiny.gpu_name(), "torch": torch.__version__}
    import transformers
    import triton
    res["triton"], res["transformers"] = triton.__version__, transformers.__version__
    t = time.perf_counter()
    hf = make_hf_checkpoint(args.work / "hf", args.num_layers, args.smoke)
    res["hf_init_save_s"] = time.perf_counter() - t
    print(f"transformers checkpoint saved in {res['hf_init_save_s']:.0f} s", flush=True)
    t = time.perf_counter()
    engine = build_engine(checkpoint=args.work / "hf", output_dir=args.work / "engine", dtype=dt, device=DEVICE,
                          max_seq_len=512 if args.smoke else 40960, max_batch_size=16, progress=False)
    res["build_s"] = time.perf_counter() - t
    t = time.perf_counter()
    # leave room for transformers' 32K prefill; graphs staged for up to 32 fused decode steps
    llm = LLM(engine, kv_cache_memory_bytes=(64 << 20) if args.smoke else 24 << 30, num_decode_steps=32,
              prefix_caching=False)
    res["load_s"] = time.perf_counter() - t
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
    res["floor_tok_s"] = 4.3e12 / weight_bytes

    # 2. Logits of a 1K prompt.
    from infhip.runtime.sequence import Sequence
    vocab = llm.engine.config.model.vocab_size
    ids = torch.randint(10, vocab, (tiny.cap(1024, args.smoke),), generator=torch.Generator().manual_seed(0)).tolist()
    seq = Sequence(seq_id=99_999, prompt_token_ids=ids, params=SamplingParams(max_tokens=1))
    llm.scheduler.add(seq)
    out = llm.scheduler.schedule()
    ours = llm.runner.execute(out)[0]
    llm.scheduler.finish(seq, "abort")
    with torch.no_grad():
        ref = hf(torch.tensor([ids], device=DEVICE), logits_to_keep=1).logits[0, -1].float()
    res["logits_rel_l2"] = ((ours - ref).norm() / ref.norm()).item()
    # Both bf16 runs against a float32 transformers run of the same weights: how far each is from
    # the exact answer, so the bf16-vs-bf16 distance can be read in context.
    from transformers import LlamaForCausalLM
    hf32 = LlamaForCausalLM.from_pretrained(args.work / "hf", dtype=torch.float32, device_map=DEVICE).eval()
    with torch.no_grad():
        ref32 = hf32(torch.tensor([ids], device=DEVICE), logits_to_keep=1).logits[0, -1].float()
    del hf32
    # transformers against itself: the same bf16 weights with its eager attention instead of
    # SDPA — two correct bf16 implementations that differ only in operation order. Their
    # distance is what any non-bit-identical bf16 implementation can be expected to reach.
    hf_eager = LlamaForCausalLM.from_pretrained(args.work / "hf", dtype=DTYPE, device_map=DEVICE,
                                                attn_implementation="eager").eval()
    with torch.no_grad():
        ref_eager = hf_eager(torch.tensor([ids], device=DEVICE), logits_to_keep=1).logits[0, -1].float()
    del hf_eager
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    res["logits_rel_l2_hf_eager_vs_hf_sdpa"] = ((ref_eager - ref).norm() / ref.norm()).item()
    res["logits_rel_l2_ours_vs_fp32"] = ((ours - ref32).norm() / ref32.norm()).item()
    res["logits_rel_l2_hf_vs_fp32"] = ((ref - ref32).norm() / ref32.norm()).item()
    print(f"vs float32 transformers: infhip {res['logits_rel_l2_ours_vs_fp32']:.3e}, "
          f"transformers bf16 {res['logits_rel_l2_hf_vs_fp32']:.3e}", flush=True)
    print(f"logits rel L2 {res['logits_rel_l2']:.3e}", flush=True)

    # 3. Decode. First how much fusing more decode steps per host sync buys at batch 1 (the
    # engine default is 8: up to 7 tokens past a stop string are computed and thrown away).
    for steps in (8, 16, 32):
        llm.core.num_decode_steps = steps
        res[f"decode_b1_steps{steps}_tok_s"] = decode_tok_s(llm, SamplingParams, 1, n1=n1, n2=n2)
        print(f"decode b=1, {steps} steps per sync: {res[f'decode_b1_steps{steps}_tok_s']:.1f} tok/s", flush=True)
    llm.core.num_decode_steps = 8
    for b in (1, 16):
        res[f"decode_b{b}_tok_s"] = decode_tok_s(llm, SamplingParams, b, n1=n1, n2=n2)
        res[f"hf_decode_b{b}_tok_s"] = hf_decode_tok_s(hf, b, n1=n1 // 4, n2=n2 // 4)
        print(f"decode b={b}: {res[f'decode_b{b}_tok_s']:.1f} vs {res[f'hf_decode_b{b}_tok_s']:.1f} tok/s", flush=True)

    # Where decode time goes at batch 1: the captured graph alone vs a whole engine step.
    # The graph these short-context steps replayed: the 512-token length bucket's (captured on
    # first use, runtime/cuda_graphs.py), and the start-up graph sized for max_seq_len beside it.
    from infhip.runtime.cuda_graphs import GraphKey

    graphs = llm.runner.graphs
    if graphs is None:  # the CPU (--smoke): no graphs to replay or profile
        print("decode b=1: no CUDA graphs here; graph replay, kernel profile and split sweep skipped", flush=True)
    else:
        graph = graphs.graphs.get((1, GraphKey(len_bucket=512)), graphs.graphs[(1, GraphKey())])
        res["decode_b1_graph_ms"] = timing.sync_time(graph.replay, reps=200) * 1e3
        res["decode_b1_startup_graph_ms"] = timing.sync_time(graphs.graphs[(1, GraphKey())].replay, reps=200) * 1e3
        print(f"decode b=1: start-up graph (splits for max_seq_len) {res['decode_b1_startup_graph_ms']:.3f} ms",
              flush=True)
        print(f"decode b=1: graph replay {res['decode_b1_graph_ms']:.3f} ms/token, "
              f"engine step {1e3 / res['decode_b1_tok_s']:.3f} ms/token", flush=True)
        res["decode_b1_kernels"] = profile_graph(graph, args.out / "decode_b1_kernels.txt")
    from infhip.plugins.skinny_gemm import skinny_gemm_decisions, table_config
    # INFHIP_SKINNY_GEMM=auto: what the timing chose; default: the fixed table's picks at M = 1
    res["skinny_gemm_decisions"] = {str(k): str(v.config or "cublas") for k, v in skinny_gemm_decisions().items()}
    if not res["skinny_gemm_decisions"]:
        shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                  "lm_head": (128256, 4096)}
        res["skinny_gemm_decisions"] = {name: str(table_config(1, n, k, torch.bfloat16) or "cublas")
                                        for name, (n, k) in shapes.items()}
    print("skinny GEMM kernels: " + "; ".join(f"{k} -> {v}" for k, v in res["skinny_gemm_decisions"].items()),
          flush=True)
    if not args.smoke:  # (the Triton kernel itself, timed in graphs)
        res["decode_split_sweep_us"] = decode_split_sweep()

    # 4. Prefill.
    prefill_lens = list(dict.fromkeys(tiny.cap(int(x), args.smoke) for x in args.prefill_lens.split(",")))
    for n in prefill_lens:
        ids = torch.randint(10, vocab, (n,)).tolist()
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        llm.generate(prompt_token_ids=[ids[:tiny.cap(1024, args.smoke)]], sampling_params=sp)
        t_ours = min(timing.sync_time(lambda: llm.generate(prompt_token_ids=[ids], sampling_params=sp)) for _ in range(2))
        x = torch.tensor([ids], device=DEVICE)
        with torch.no_grad():
            hf(x[:, :tiny.cap(1024, args.smoke)], logits_to_keep=1)
            t_hf = min(timing.sync_time(lambda: hf(x, logits_to_keep=1)) for _ in range(2))
        res[f"prefill_{n}_tok_s"], res[f"hf_prefill_{n}_tok_s"] = n / t_ours, n / t_hf
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    (args.out / "bench_dense_llama8b.json").write_text(json.dumps(res, indent=2))
    print(f"\n{res['gpu']}  torch {res['torch']}  triton {res['triton']}  transformers {res['transformers']}")
    print(f"build {res['build_s']:.0f} s, load {res['load_s']:.0f} s; {FLOOR_NOTE}: {res['floor_tok_s']:.0f} tok/s")
    print(f"{'metric':<28}{'infhip':>12}{'transformers':>14}{'ratio':>8}")
    print(f"{'logits rel L2 (1K prompt)':<28}{res['logits_rel_l2']:>12.2e}   (bf16 infhip vs bf16 transformers)")
    print(f"{'  each vs fp32 transformers':<28}{res['logits_rel_l2_ours_vs_fp32']:>12.2e}"
          f"{res['logits_rel_l2_hf_vs_fp32']:>14.2e}")
    print(f"{'  transformers eager vs SDPA':<28}{'':>12}{res['logits_rel_l2_hf_eager_vs_hf_sdpa']:>14.2e}"
          "   (both bf16: the spread between two correct bf16 implementations)")
    for key, name in [("decode_b1", "decode b=1 tok/s"), ("decode_b16", "decode b=16 tok/s")] + [
            (f"prefill_{n}", f"prefill {n} tok/s") for n in prefill_lens]:
        a, b = res[f"{key}_tok_s"], res[f"hf_{key}_tok_s"]
        print(f"{name:<28}{a:>12.1f}{b:>14.1f}{a / b:>8.2f}")
    print(f"{'decode b=1 / floor':<28}{res['decode_b1_tok_s'] / res['floor_tok_s']:>12.2f}")
    for steps in (16, 32):
        print(f"{f'decode b=1, {steps} steps/sync':<28}{res[f'decode_b1_steps{steps}_tok_s']:>12.1f}"
              f"{'':>14}{res[f'decode_b1_steps{steps}_tok_s'] / res['floor_tok_s']:>8.2f} of floor")


if __name__ == "__main__":
    main()
