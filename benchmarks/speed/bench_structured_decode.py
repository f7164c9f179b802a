"""Decode speed under a grammar against plain decode, in the same run (the goal "with a JSON
schema >= 0.95x plain decode"): batch 1 and 16, greedy, short prompts, `--tokens` each.

    python -m benchmarks.speed.bench_structured_decode --engine engines/l8b [--batch 1 16] [--tokens 256] \
        [--repeats 3] [--out structured_decode.json]

The constrained rows use the JSON schema {"text": string}: on random weights the string never
closes within --tokens (closing needs one given token), so every step runs the whole grammar
path (matcher advance, bitmask fill on the host, one copy, the mask on the device) and the
rows stay in the batch as long as the plain ones (ignore_eos on both). Grammar rows run the
back-to-back decode steps plain rows do; between two steps the host reads the last tokens,
advances the matchers and fills the next mask while the next forward runs
(runtime/structured_output.py): whatever of that does not hide under the forward is part of
what this measures.
Prints one row per batch size: plain and JSON tok/s (medians of --repeats), their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def rate(llm, batch: int, tokens: int, structured: bool) -> float:
    from infhip import SamplingParams, StructuredOutputsParams
    spec = StructuredOutputsParams(json=SCHEMA) if structured else None
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, structured_outputs=spec)
    prompts = [[1 + (7 * i + j) % 50 for j in range(8)] for i in range(batch)]  # 8-token prompts: prefill is noise
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    dt = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from infhip import LLM
    llm = LLM(args.engine, max_num_seqs=max(args.batch))
    rows = []
    for b in args.batch:
        rate(llm, b, 8, True)  # warm-up: builds the grammar compiler, compiles the schema, first graphs
        rate(llm, b, 8, False)
        plain, constrained = [], []
        for _ in range(args.repeats):  # interleaved: drift hits both alike
            plain.append(rate(llm, b, args.tokens, False))
            constrained.append(rate(llm, b, args.tokens, True))
        p, c = statistics.median(plain), statistics.median(constrained)
        rows.append({"batch": b, "tokens": args.tokens, "plain_tok_s": p, "json_tok_s": c, "ratio": c / p})
    print(f"{'batch':>5} {'plain tok/s':>12} {'json tok/s':>11} {'ratio':>6}")
    for r in rows:
        print(f"{r['batch']:>5} {r['plain_tok_s']:>12.1f} {r['json_tok_s']:>11.1f} {r['ratio']:>6.3f}")
    if args.out:
        args.out.write_text(json.dumps({"engine": str(args.engine), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
