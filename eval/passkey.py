"""Passkey retrieval: a 5-digit number hidden at a depth of a haystack; exact-match score.

    >>> from infhip.eval.passkey import PasskeyConfig, run_passkey               # doctest: +SKIP
    >>> res = run_passkey(["engines/smollm2-135m"], PasskeyConfig(lengths=[1024], depths=[0.5]))  # doctest: +SKIP
    >>> print(res.markdown())  # doctest: +SKIP

The prompt (`passkey_prompt_ids`) is the classic one (Mohtashami & Jaggi 2023): an instruction,
the noise sentences (or KJV text, or PG essays) cut to exactly the requested token count, the needle
"The pass key is N. Remember it. N is the pass key." and "What is the pass key? The pass key is".
Greedy decoding of 8 tokens; correct when the first integer in the answer equals N.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass, field

from infhip.eval.common import check_fits, engine_info, engine_name, load_llm
from infhip.eval.prompts import assemble
from infhip.eval.results import EvalResult, Record
from infhip.eval.text import SOURCES

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n\n")
QUESTION = "\n\nWhat is the pass key? The pass key is"
MAX_NEW_TOKENS = 8


@dataclass
class PasskeyConfig:
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    samples: int = 1
    seed: int = 0
    haystack: str = "noise"  # "noise" | "kjv" | "pg" (text.SOURCES)

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.haystack not in SOURCES:
            raise ValueError(f"haystack must be one of {', '.join(SOURCES)}, got {self.haystack!r}")
        if any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError(f"depths must be in [0, 1], got {self.depths}")


def passkey_value(seed: int, length: int, depth: float, sample: int) -> int:
    """The number hidden in one prompt: a deterministic function of its coordinates."""
    return random.Random(f"passkey-{seed}-{length}-{depth}-{sample}").randint(10000, 99999)


def passkey_prompt_ids(tokenizer, num_tokens: int, depth: float, passkey: int,
                       haystack: str = "noise", seed: int = 0) -> list[int]:
    """Exactly `num_tokens` ids with the passkey needle at fraction `depth` of the haystack."""
    needle = f" The pass key is {passkey}. Remember it. {passkey} is the pass key."
    return assemble(tokenizer, num_tokens, INTRO, [(depth, needle)], QUESTION, haystack, seed)


def first_int(text: str) -> int | None:
    found = re.findall(r"\d+", text)
    return int(found[0]) if found else None


def run_passkey(engines: list[str], cfg: PasskeyConfig, device: str | None = None, log=print,
                **llm_kwargs) -> EvalResult:
    from infhip import SamplingParams

    records, infos = [], {}
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
    for engine in engines:
        llm, name = load_llm(engine, device, **llm_kwargs), engine_name(engine)
        infos[name] = engine_info(llm)
        for length in cfg.lengths:
            check_fits(llm, length, MAX_NEW_TOKENS)
            cases = [(d, s, passkey_value(cfg.seed, length, d, s)) for d in cfg.depths for s in range(cfg.samples)]
            prompts = [passkey_prompt_ids(llm.tokenizer, length, d, key, cfg.haystack, seed=cfg.seed * 1000 + s)
                       for d, s, key in cases]
            t0 = time.perf_counter()
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            dt = time.perf_counter() - t0
            for (d, s, key), out in zip(cases, outs):
                ok = first_int(out.text) == key
                records.append(Record("passkey", name, length, float(ok), depth=d, sample=s,
                                      extra={"expected": key, "answer": out.text, "seconds": dt / len(cases)}))
            acc = sum(r.score for r in records[-len(cases):]) / len(cases)
            log(f"passkey {name} {length}: {acc:.3f} ({len(cases)} prompts, {dt:.1f} s)")
    return EvalResult("passkey", {"lengths": cfg.lengths, "depths": cfg.depths, "samples": cfg.samples,
                                  "seed": cfg.seed, "haystack": cfg.haystack, "engines": engines,
                                  "engine_info": infos}, records)
