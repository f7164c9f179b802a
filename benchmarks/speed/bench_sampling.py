"""Decode throughput with the sampling features on vs plain decode, in the same run (goal:
logprobs=5 and penalties each >= 0.95x plain at batch 1 and 16).

    python -m benchmarks.speed.bench_sampling --engine engines/smollm2-135m [--batch-sizes 1,16] [--tokens 256] \\
        [--repeats 3] [--out $OUT/sampling.json]

Per batch size and variant: B requests of the same random 128-token prompt (prefix caching off,
so every run prefills alike), greedy, ignore_eos, N tokens each; output tok/s = B * N / wall
time (the 128-token prefill is inside it, the same in every variant: small against N = 256
decode steps on a GPU). Variants run interleaved, `--repeats` times, median
kept; ratios are against plain in the same run. Variants: plain; logprobs=5 (the chosen token's
logprob, rank and top 5 of the raw logits: two Triton launches per step, plugins/sampling.py);
penalties (repetition 1.1, frequency 0.5, presence 0.5: output counts kept on the device across
scheduler steps, runtime/penalty_slots.py, applied with the other stages in one launch and
advanced in one).
Prints a table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from infhip import LLM, SamplingParams

VARIANTS = {
    "plain": {},
    "logprobs=5": {"logprobs": 5},
    "penalties": {"repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": 0.5},
}


def _time(llm: LLM, prompts: list[list[int]], tokens: int, extra: dict) -> float:
    sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, **extra)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM(args.engine, max_num_seqs=max(sizes), prefix_caching=False)
    vocab = llm.engine.config.model.vocab_size
    prompt = torch.randint(3, vocab, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    for b in sizes:
        prompts = [prompt] * b
        for extra in VARIANTS.values():  # warm-up: graphs, kernels
            _time(llm, prompts, 8, extra)
        tps = {name: [] for name in VARIANTS}
        for _ in range(args.repeats):
            for name, extra in VARIANTS.items():
                tps[name].append(b * args.tokens / _time(llm, prompts, args.tokens, extra))
        plain = statistics.median(tps["plain"])
        for name in VARIANTS:
            tok_s = statistics.median(tps[name])
            rows.append({"batch": b, "variant": name, "output_tok_s": round(tok_s, 1),
                         "vs_plain": round(tok_s / plain, 3), "runs": [round(x, 1) for x in tps[name]]})
            print(f"batch {b:3d}  {name:12s} {tok_s:10.1f} tok/s  {tok_s / plain:6.3f}x plain", flush=True)
    report = {"engine": args.engine, "tokens": args.tokens, "repeats": args.repeats,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
