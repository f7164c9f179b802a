"""RULER-style needle-in-a-haystack (Hsieh et al. 2024, the NIAH family), generated offline.

Needles read "One of the special magic numbers for {key} is: {value}." with a two-word key and a
7-digit value. Variants:

    single      one needle at the depth; asked for its value
    multikey    the needle at the depth + 3 distractor needles with other keys at random depths
    multivalue  4 needles of one key with different values (first at the depth); asked for all
    multiquery  4 needles of different keys (first at the depth); asked for all 4 values

Haystack: KJV text (default), PG essays or the repeated noise sentences. Everything is a deterministic
function of (variant, seed, length, depth, sample). Score: single/multikey 1 when the first
number of the answer is the value; multivalue/multiquery the fraction of values in the answer.

    >>> case = niah_case("multikey", seed=0, length=4096, depth=0.5, sample=0)
    >>> len(case.needles), len(case.answers)
    (4, 1)
    >>> case == niah_case("multikey", seed=0, length=4096, depth=0.5, sample=0)
    True
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass, field

from infhip.eval.common import EvalError, check_fits, engine_info, engine_name, load_llm
from infhip.eval.prompts import assemble
from infhip.eval.results import EvalResult, Record
from infhip.eval.text import SOURCES

VARIANTS = ("single", "multikey", "multivalue", "multiquery")
INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
         "I will quiz you about the numbers afterwards.\n")
_ADJ = ("amber", "brave", "calm", "dusty", "eager", "fancy", "gentle", "hollow", "icy", "jolly", "kind",
        "lively", "misty", "noble", "odd", "proud", "quiet", "rapid", "silver", "tidy", "upbeat", "vivid",
        "wary", "young", "zesty", "bold", "crisp", "dim", "faint", "grand")
_NOUN = ("anchor", "badger", "candle", "dolphin", "engine", "falcon", "garden", "harbor", "island",
         "jacket", "kettle", "lantern", "meadow", "needle", "orchid", "pepper", "quartz", "rocket",
         "saddle", "tunnel", "umbrella", "violin", "wagon", "yacht", "zebra", "basket", "cactus",
         "drum", "feather", "glacier")
NUM_DISTRACTORS, NUM_MULTI = 3, 4


@dataclass(frozen=True)
class NiahCase:
    variant: str
    needles: tuple[tuple[float, str], ...]  # (depth, text), text starts with a space
    question: str
    answers: tuple[int, ...]  # values the answer must contain (the first one for single/multikey)

    @property
    def max_new_tokens(self) -> int:
        return 12 if len(self.answers) == 1 else 16 * len(self.answers)


def _needle(key: str, value: int) -> str:
    return f" One of the special magic numbers for {key} is: {value}."


def niah_case(variant: str, seed: int, length: int, depth: float, sample: int) -> NiahCase:
    if variant not in VARIANTS:
        raise EvalError(f"unknown niah variant {variant!r}; choose from {', '.join(VARIANTS)}")
    rng = random.Random(f"niah-{variant}-{seed}-{length}-{depth}-{sample}")
    num_keys = {"single": 1, "multikey": 1 + NUM_DISTRACTORS, "multivalue": 1, "multiquery": NUM_MULTI}[variant]
    keys = [f"{a}-{n}" for a, n in rng.sample([(a, n) for a in _ADJ for n in _NOUN], num_keys)]
    num_values = NUM_MULTI if variant == "multivalue" else num_keys
    values = rng.sample(range(1_000_000, 10_000_000), num_values)
    depths = [depth] + [rng.random() for _ in range(num_values - 1)]
    needle_keys = keys * num_values if variant == "multivalue" else keys
    needles = tuple((d, _needle(k, v)) for d, k, v in zip(depths, needle_keys, values))
    if variant in ("single", "multikey"):
        k = keys[0]
        question = (f"\nWhat is the special magic number for {k} mentioned in the provided text? "
                    f"The special magic number for {k} mentioned in the provided text is")
        answers = (values[0],)
    else:
        asked = keys[0] if variant == "multivalue" else ", ".join(keys[:-1]) + f" and {keys[-1]}"
        question = (f"\nWhat are all the special magic numbers for {asked} mentioned in the provided text? "
                    f"The special magic numbers for {asked} mentioned in the provided text are")
        answers = tuple(values)
    return NiahCase(variant, needles, question, answers)


def niah_prompt_ids(tokenizer, case: NiahCase, length: int, haystack: str = "kjv", seed: int = 0) -> list[int]:
    return assemble(tokenizer, length, INTRO, list(case.needles), case.question, haystack, seed)


def score_answer(case: NiahCase, text: str) -> float:
    numbers = [int(x) for x in re.findall(r"\d+", text)]
    if len(case.answers) == 1:
        return float(bool(numbers) and numbers[0] == case.answers[0])
    return sum(a in numbers for a in case.answers) / len(case.answers)


@dataclass
class NiahConfig:
    lengths: list[int] = field(default_factory=lambda: [4096])
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    samples: int = 1
    seed: int = 0
    haystack: str = "kjv"

    def __post_init__(self) -> None:
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad or not self.variants:
            raise EvalError(f"unknown niah variants {bad}; choose from {', '.join(VARIANTS)}")
        if self.samples < 1 or self.haystack not in SOURCES:
            raise EvalError(f"samples must be >= 1 and haystack one of {', '.join(SOURCES)}")


def run_niah(engines: list[str], cfg: NiahConfig, device: str | None = None, log=print,
             **llm_kwargs) -> EvalResult:
    from infhip import SamplingParams

    records, infos = [], {}
    for engine in engines:
        llm, name = load_llm(engine, device, **llm_kwargs), engine_name(engine)
        infos[name] = engine_info(llm)
        for length in cfg.lengths:
            for variant in cfg.variants:
                cases = [(d, s, niah_case(variant, cfg.seed, length, d, s))
                         for d in cfg.depths for s in range(cfg.samples)]
                check_fits(llm, length, max(c.max_new_tokens for _, _, c in cases))
                prompts = [niah_prompt_ids(llm.tokenizer, c, length, cfg.haystack, seed=cfg.seed * 1000 + s)
                           for d, s, c in cases]
                params = [SamplingParams(max_tokens=c.max_new_tokens, temperature=0.0) for _, _, c in cases]
                t0 = time.perf_counter()
                outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
                for (d, s, c), out in zip(cases, outs):
                    records.append(Record("niah", name, length, score_answer(c, out.text), depth=d, sample=s,
                                          variant=variant, extra={"expected": list(c.answers), "answer": out.text}))
                mean = sum(r.score for r in records[-len(cases):]) / len(cases)
                log(f"niah {name} {length} {variant}: {mean:.3f} ({len(cases)} prompts, "
                    f"{time.perf_counter() - t0:.1f} s)")
    return EvalResult("niah", {"lengths": cfg.lengths, "variants": cfg.variants, "depths": cfg.depths,
                               "samples": cfg.samples, "seed": cfg.seed, "haystack": cfg.haystack,
                               "engines": engines, "engine_info": infos}, records)
