"""Perplexity of real text (KJV, or PG essays with text="pg") at given context lengths: the loss of the last `chunk` tokens of a
`length`-token window given everything before them.

    >>> from infhip.eval.ppl import PplConfig, run_ppl                              # doctest: +SKIP
    >>> print(run_ppl(["engines/smollm2-135m"], PplConfig(lengths=[1024], chunk=128)).markdown())  # doctest: +SKIP

Windows start at verses picked by (seed, sample). Scoring goes through `teacher_force`: one
prefill of the context, then one decode step per target token (see forcing.py for why). Score per
sample = exp(mean NLL of the chunk); the summary is their geometric mean = exp(mean NLL).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from infhip.eval.common import EvalError, check_fits, engine_info, engine_name, load_llm
from infhip.eval.forcing import target_log_probs
from infhip.eval.prompts import special_prefix
from infhip.eval.results import EvalResult, Record
from infhip.eval.text import SOURCES, token_window


@dataclass
class PplConfig:
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    chunk: int = 256
    samples: int = 4
    seed: int = 0
    text: str = "kjv"  # text.SOURCES

    def __post_init__(self) -> None:
        if self.text not in SOURCES:
            raise ValueError(f"text must be one of {', '.join(SOURCES)}, got {self.text!r}")
        if self.chunk < 1 or self.samples < 1:
            raise ValueError(f"chunk and samples must be >= 1, got {self.chunk}, {self.samples}")
        if any(n <= self.chunk for n in self.lengths):
            raise ValueError(f"every length must exceed chunk ({self.chunk}), got {self.lengths}")


def ppl_items(tokenizer, length: int, chunk: int, samples: int, seed: int,
              text: str = "kjv") -> list[tuple[list[int], list[int]]]:
    """(context, target) per sample: `length` tokens of `text` in all (special prefix included)."""
    prefix = special_prefix(tokenizer)
    items = []
    for s in range(samples):
        ids = prefix + token_window(tokenizer, length - len(prefix), text, seed=seed * 1000 + s)
        items.append((ids[:-chunk], ids[-chunk:]))
    return items


def run_ppl(engines: list[str], cfg: PplConfig, device: str | None = None, log=print,
            **llm_kwargs) -> EvalResult:
    records, infos = [], {}
    for engine in engines:
        llm, name = load_llm(engine, device, **llm_kwargs), engine_name(engine)
        infos[name] = engine_info(llm)
        for length in cfg.lengths:
            check_fits(llm, length)
            items = ppl_items(llm.tokenizer, length, cfg.chunk, cfg.samples, cfg.seed, cfg.text)
            t0 = time.perf_counter()
            log_probs = target_log_probs(llm, items)
            for s, lp in enumerate(log_probs):
                nll = -lp.mean().item()
                records.append(Record("ppl", name, length, math.exp(nll), metric="ppl", sample=s,
                                      extra={"nll": nll, "chunk": cfg.chunk}))
            mean_nll = sum(-lp.mean().item() for lp in log_probs) / len(log_probs)
            log(f"ppl {name} {length}: {math.exp(mean_nll):.3f} ({cfg.samples} x {cfg.chunk} tokens, "
                f"{time.perf_counter() - t0:.1f} s)")
    if not records:
        raise EvalError("no engines given")
    return EvalResult("ppl", {"lengths": cfg.lengths, "chunk": cfg.chunk, "samples": cfg.samples,
                              "seed": cfg.seed, "text": cfg.text, "engines": engines, "engine_info": infos}, records)
