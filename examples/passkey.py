"""Passkey retrieval: hide a number in a long filler prompt and ask the model for it.

    python examples/passkey.py --engine engines/smollm2-135m --length 3000 --depth 0.5

Prints the model's answer, whether it found the passkey, and timings. Exit code 0 on a correct
answer, 1 otherwise (so it can gate a demo), 2 on bad input. The prompt comes from the quality
harness (`infhip.eval.passkey`), which runs the same test over many lengths, depths and samples:
`infhip-eval passkey --engine engines/smollm2-135m --lengths 1k,2k,4k --samples 5`.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from infhip import LLM, SamplingParams
from infhip.eval.passkey import MAX_NEW_TOKENS, first_int, passkey_prompt_ids


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True)
    p.add_argument("--length", type=int, default=3000, help="prompt length in tokens (exact)")
    p.add_argument("--depth", type=float, default=0.5, help="where the passkey sits (0 = start, 1 = end)")
    p.add_argument("--haystack", choices=("noise", "kjv"), default="noise", help="filler text")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    if not 0.0 <= args.depth <= 1.0:
        print("passkey.py: error: --depth must be in [0, 1]", file=sys.stderr)
        return 2

    t0 = time.perf_counter()
    llm = LLM(args.engine, device=args.device)
    if llm.tokenizer is None:
        print("passkey.py: error: the engine has no tokenizer (random weights?)", file=sys.stderr)
        return 2
    passkey = random.Random(args.seed).randint(10000, 99999)
    try:
        ids = passkey_prompt_ids(llm.tokenizer, args.length, args.depth, passkey, args.haystack, args.seed)
    except ValueError as e:
        print(f"passkey.py: error: {e}", file=sys.stderr)
        return 2
    t1 = time.perf_counter()
    out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=MAX_NEW_TOKENS,
                                                                              temperature=0.0))[0]
    t2 = time.perf_counter()
    ok = first_int(out.text) == passkey
    print(f"prompt: {len(out.prompt_token_ids)} tokens, passkey {passkey} at depth {args.depth}")
    print(f"answer: {out.text.strip()!r}")
    print(f"result: {'CORRECT' if ok else 'WRONG'}   (load {t1 - t0:.1f} s, generate {t2 - t1:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
