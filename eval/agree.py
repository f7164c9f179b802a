"""Teacher-forced agreement of an engine with a reference engine (usually the dense one).

On the same KJV windows, both engines score the last `chunk` tokens given everything before
(`teacher_force`); per position we compare their next-token distributions:

    top1  = [argmax p_engine == argmax p_ref]
    kl    = KL(p_ref || p_engine) = sum p_ref (log p_ref - log p_engine)   (nats, float64)

Both engines run in lockstep, one position at a time, so no [chunk, vocab] logits are kept.
Records: metric "top1" and "kl" per (length, sample), variant = the reference's name.

    >>> from infhip.eval.agree import AgreeConfig, run_agree                         # doctest: +SKIP
    >>> run_agree(["engines/x-3k"], "engines/x-dense", AgreeConfig(lengths=[8192])).markdown()  # doctest: +SKIP
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from infhip.eval.common import EvalError, check_fits, engine_info, engine_name, load_llm
from infhip.eval.forcing import teacher_force
from infhip.eval.ppl import ppl_items
from infhip.eval.results import EvalResult, Record


@dataclass
class AgreeConfig:
    lengths: list[int] = field(default_factory=lambda: [4096])
    chunk: int = 128
    samples: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.chunk < 1 or self.samples < 1 or any(n <= self.chunk for n in self.lengths):
            raise EvalError(f"need chunk >= 1, samples >= 1 and every length > chunk; got {self}")


def compare_logits(engine_logits: torch.Tensor, ref_logits: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement 0/1, KL(ref || engine)) of one position.

        >>> compare_logits(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0]))
        (1.0, 0.0)
    """
    lp, lq = engine_logits.double().log_softmax(-1), ref_logits.double().log_softmax(-1)
    kl = (lq.exp() * (lq - lp)).sum().clamp_min(0.0).item()
    return float(engine_logits.argmax() == ref_logits.argmax()), kl


def agreement(llm, ref, items) -> list[tuple[float, float]]:
    """Mean (top1, kl) per item, running both engines position by position."""
    sums = [[0.0, 0.0] for _ in items]
    pending: dict[tuple[int, int], torch.Tensor] = {}  # positions one engine produced before the other
    for a, b in zip(teacher_force(llm, items), teacher_force(ref, items)):
        for side, (i, j, logits) in (("e", a), ("r", b)):
            other = pending.pop(("r" if side == "e" else "e", i, j), None)
            if other is None:
                pending[(side, i, j)] = logits.clone()
                continue
            e, r = (logits, other) if side == "e" else (other, logits)
            top1, kl = compare_logits(e, r)
            sums[i][0] += top1
            sums[i][1] += kl
    if pending:
        raise RuntimeError(f"{len(pending)} positions scored by one engine only")
    return [(t / len(tgt), k / len(tgt)) for (t, k), (_, tgt) in zip(sums, items)]


def run_agree(engines: list[str], reference: str, cfg: AgreeConfig, device: str | None = None,
              log=print, **llm_kwargs) -> EvalResult:
    ref, ref_name = load_llm(reference, device, **llm_kwargs), engine_name(reference)
    records, infos = [], {ref_name: engine_info(ref)}
    for engine in engines:
        llm, name = load_llm(engine, device, **llm_kwargs), engine_name(engine)
        infos[name] = engine_info(llm)
        if llm.engine.config.model.vocab_size != ref.engine.config.model.vocab_size:
            raise EvalError(f"{name} and {ref_name} have different vocabularies: build both from one model")
        for length in cfg.lengths:
            check_fits(llm, length)
            check_fits(ref, length)
            items = ppl_items(llm.tokenizer, length, cfg.chunk, cfg.samples, cfg.seed)
            t0 = time.perf_counter()
            for s, (top1, kl) in enumerate(agreement(llm, ref, items)):
                records.append(Record("agree", name, length, top1, metric="top1", sample=s, variant=ref_name))
                records.append(Record("agree", name, length, kl, metric="kl", sample=s, variant=ref_name))
            log(f"agree {name} vs {ref_name} {length}: {cfg.samples} x {cfg.chunk} positions, "
                f"{time.perf_counter() - t0:.1f} s")
    return EvalResult("agree", {"lengths": cfg.lengths, "chunk": cfg.chunk, "samples": cfg.samples,
                                "seed": cfg.seed, "engines": engines, "reference": reference,
                                "engine_info": infos}, records)
