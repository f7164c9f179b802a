"""Passkey retrieval: hide a number in a long filler prompt and ask the model for it.

    python examples/passkey.py --engine engines/smollm2-135m --length 3000 --depth 0.5

Prints the model's answer, whether it found the passkey, and timings. Exit code 0 on a correct
answer, 1 otherwise (so it can gate a demo), 2 on bad input.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time

from infhip import LLM, SamplingParams

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "\n\nWhat is the pass key? The pass key is"


def passkey_prompt(tokenizer, num_tokens: int, depth: float, passkey: int) -> str:
    """A prompt of about `num_tokens` tokens with the passkey sentence at fraction `depth` of the filler."""
    needle = f"The pass key is {passkey}. Remember it. {passkey} is the pass key. "
    fixed = len(tokenizer(INTRO + needle + QUESTION)["input_ids"])
    per_filler = len(tokenizer(FILLER * 10)["input_ids"]) / 10
    num_fillers = max(1, int((num_tokens - fixed) / per_filler))
    before = round(num_fillers * depth)
    return INTRO + FILLER * before + needle + FILLER * (num_fillers - before) + QUESTION


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True)
    p.add_argument("--length", type=int, default=3000, help="prompt length in tokens")
    p.add_argument("--depth", type=float, default=0.5, help="where the passkey sits (0 = start, 1 = end)")
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
    prompt = passkey_prompt(llm.tokenizer, args.length, args.depth, passkey)
    t1 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    t2 = time.perf_counter()
    found = re.findall(r"\d+", out.text)
    ok = bool(found) and int(found[0]) == passkey
    print(f"prompt: {len(out.prompt_token_ids)} tokens, passkey {passkey} at depth {args.depth}")
    print(f"answer: {out.text.strip()!r}")
    print(f"result: {'CORRECT' if ok else 'WRONG'}   (load {t1 - t0:.1f} s, generate {t2 - t1:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
