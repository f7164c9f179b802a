"""Token-drop retention per anchor layer on real text: the share of a prompt's tokens each
full-attention layer keeps (infhip/methods/token_drop/runtime/step.py records it per sequence in
``runner.transforms["token_drop"].stats.retention``: anchor layer -> [kept, total] summed over the prompt's chunks).

    python -m infhip.eval.retention --engine engines/smollm2-135m-td99 --lengths 4k --samples 2

Prompts are the ppl task's KJV windows (the same seed gives the same text). Prints a markdown
table: one row per anchor layer, one column per length (mean over samples), and a last row with
the mean over anchors; ``--json`` writes every value.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from infhip.eval.common import EvalError, check_fits, engine_name, load_llm, parse_lengths
from infhip.eval.ppl import ppl_items
from infhip.runtime.options import add_load_options, load_options
from infhip.runtime.sampling_params import SamplingParams


def anchor_retention(llm, prompts: list[list[int]]) -> list[dict[int, float]]:
    """Prefill each prompt (one token generated); per prompt {anchor layer: kept / total}.
    A prompt that dropped nothing (shorter than min_prompt_len, or no token drop) gives {}."""
    if llm.runner.transforms["token_drop"].cfg is None:
        raise EvalError("engine has no token drop (build with --token-drop, or load with token_drop=True)")
    out = []
    for ids in prompts:
        before = set(llm.runner.transforms["token_drop"].stats.retention)
        llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=1, temperature=0.0))
        new = [sid for sid in llm.runner.transforms["token_drop"].stats.retention if sid not in before]
        per_layer = llm.runner.transforms["token_drop"].stats.retention[new[-1]] if new else {}
        out.append({layer: kept / total for layer, (kept, total) in sorted(per_layer.items())})
    return out


def run_retention(engine: str, lengths: list[int], samples: int = 2, seed: int = 0,
                  device: str | None = None, **llm_kwargs) -> dict:
    llm = load_llm(engine, device, **llm_kwargs)
    knobs = llm.runner.transforms["token_drop"].cfg
    result = {"engine": engine_name(engine), "token_drop": None if knobs is None else vars(knobs), "lengths": {}}
    for length in lengths:
        check_fits(llm, length)
        prompts = [ctx + tgt for ctx, tgt in ppl_items(llm.tokenizer, length, 1, samples, seed)]
        result["lengths"][length] = anchor_retention(llm, prompts)
    return result


def markdown(result: dict) -> str:
    lengths = list(result["lengths"])
    layers = sorted({layer for per in result["lengths"].values() for s in per for layer in s})
    head = f"| anchor layer ({result['engine']}) | " + " | ".join(f"{n // 1024}K" if n % 1024 == 0 else str(n)
                                                                 for n in lengths) + " |"
    rows = [head, "|---" * (len(lengths) + 1) + "|"]

    def mean(xs):
        return sum(xs) / len(xs) if xs else float("nan")

    for layer in layers:
        cells = [mean([s[layer] for s in result["lengths"][n] if layer in s]) for n in lengths]
        rows.append(f"| {layer} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    cells = [mean([v for s in result["lengths"][n] for v in s.values()]) for n in lengths]
    rows.append("| mean | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infhip.eval.retention", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True)
    p.add_argument("--lengths", default="4k")
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the per-sample values here")
    add_load_options(p)  # LLM's options (runtime/options.py)
    args = p.parse_args(argv)
    try:
        opts = load_options(args)
        kwargs = {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts) if f.name != "device"}
        result = run_retention(args.engine, parse_lengths(args.lengths), args.samples, args.seed, opts.device,
                               **kwargs)
    except (EvalError, ValueError, FileNotFoundError) as e:
        print(f"retention: error: {e}", file=sys.stderr)
        return 2
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
