"""RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?"): its 13 synthetic tasks, generated with the engine's tokenizer and scored as RULER
scores them.

    infhip-eval ruler --engine E --tasks niah_single_1,vt,cwe,fwe,qa_1 --lengths 8k,16k --samples 4

Our own code, written from the task definitions, templates and generators that
`nvidia-long-context-eval` 26.3 ships (`long_context_eval/synthetic.yaml`, `data/synthetic/*.py`,
`data/synthetic/constants.py`, `long_context_eval/eval/synthetic/constants.py`), and reading only its data files
(PG essays, SQuAD, HotpotQA) and the word lists of `wonderwords` (its `assets/*.txt`; RULER
calls it for the same files). Neither package is imported.

Per task (`TASKS`, RULER's synthetic.yaml): a generator builds the prompt body for a haystack
size `n` (essay words, repeated sentences, noise lines, list words, coded words or documents);
`fit_size` finds the largest `n` whose prompt plus the task's tokens to generate fits the length
(RULER grows `n` in fixed steps until it overflows; `fit_size` finds the largest fitting size
to one unit, in a handful of tokenizations). The prompt is RULER's task
template with its answer prefix, raw ("base", RULER's default) or inside the tokenizer's chat
template ("chat": the answer prefix then opens the assistant's turn, as RULER's chat templates
do). Scores are RULER's, in 0..100: `string_match_all` (the share of the references found in
the prediction, case-insensitive) for NIAH, VT, CWE and FWE; `string_match_part` (100 if any
reference is found) for QA, after RULER's postprocessing of the prediction.

Where we differ from RULER's scripts, and why:
  * essays are split into sentences with a regular expression, not NLTK's punkt (its model is a
    download); it only places needles at sentence starts;
  * a NIAH word key is a random adjective and a random noun (uniform over the pairs, as RULER's
    choice from the 6.2M-entry list of all pairs is, without building that list);
  * every random draw comes from a generator seeded by (task, seed, length, sample): a prompt
    does not depend on which other prompts were generated;
  * FWE's prompt leaves room for its 50 generated tokens like every other task (RULER fits FWE's
    prompt alone to the length);
  * VT variable names are drawn until distinct (RULER appends extra names on a collision).

    >>> score_prediction("The numbers are 1234567 and 7654321.", ["1234567", "7654321"], "all")
    100.0
    >>> score_prediction("1234567", ["1234567", "7654321"], "all")
    50.0
    >>> score_prediction("Paris, France", ["paris", "Lyon"], "part")
    100.0
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass, field

from infhip.eval.common import EvalError, check_fits, engine_info, engine_name, load_llm
from infhip.eval.prompts import encode
from infhip.eval.results import EvalResult, Record
from infhip.eval.ruler_prompts import ruler_prompts
# What callers reach through this module (`ruler.X`): the tasks (ruler_tasks.py) and prompts
# (ruler_prompts.py) live in their own modules.
from infhip.eval.ruler_prompts import fit_size, prompt_builder, ruler_prompt, vt_icl_for  # noqa: F401
from infhip.eval.ruler_tasks import KINDS, TASKS, TEMPLATES, Ctx, size_range, word_list  # noqa: F401


# ------------------------------------------------------------------------------ scoring

def postprocess(prediction: str) -> str:
    """RULER's postprocess_pred: strip, control characters to newlines, strip."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def score_prediction(prediction: str, references: list[str], metric: str) -> float:
    """RULER's per-sample string_match_all ("all") or string_match_part ("part"), in 0..100."""
    pred = postprocess(prediction).lower()
    hits = [1.0 if r.lower() in pred else 0.0 for r in references]
    return 100.0 * (sum(hits) / len(hits) if metric == "all" else max(hits))


# ------------------------------------------------------------------------------ the task

@dataclass
class RulerConfig:
    lengths: list[int] = field(default_factory=lambda: [4096])
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    samples: int = 1
    seed: int = 0
    template: str = "base"  # "base" | "chat"
    max_new_tokens: int | None = None  # a cap under RULER's per-task budget (None: RULER's, 128 for NIAH)

    def __post_init__(self) -> None:
        bad = [t for t in self.tasks if t not in TASKS]
        if bad or not self.tasks:
            raise EvalError(f"unknown RULER tasks {bad}; choose from {', '.join(TASKS)}")
        if self.samples < 1 or self.template not in TEMPLATES:
            raise EvalError(f"samples must be >= 1 and template one of {', '.join(TEMPLATES)}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise EvalError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")


class RulerResult(EvalResult):
    """An EvalResult whose table has a row per (engine, task) and the engine's mean over tasks."""

    def markdown(self) -> str:
        lengths = sorted({r.length for r in self.records})
        cells: dict[tuple[str, str], dict[int, list[float]]] = {}
        for r in self.records:
            cells.setdefault((r.engine, r.variant), {}).setdefault(r.length, []).append(r.score)
        lines = ["| engine | task | " + " | ".join(str(n) for n in lengths) + " |", "|---|---|" + "---|" * len(lengths)]
        for engine in dict.fromkeys(e for e, _ in cells):
            rows = {t: by_len for (e, t), by_len in cells.items() if e == engine}
            for task, by_len in rows.items():
                lines.append(f"| {engine} | {task} | " + " | ".join(
                    f"{sum(by_len[n]) / len(by_len[n]):.1f}" if n in by_len else "" for n in lengths) + " |")
            means = [[sum(v[n]) / len(v[n]) for v in rows.values() if n in v] for n in lengths]
            lines.append(f"| {engine} | **mean** | " + " | ".join(
                f"**{sum(m) / len(m):.1f}**" if m else "" for m in means) + " |")
            kept = [[r.extra["retention"] for r in self.records
                     if r.engine == engine and r.length == n and "retention" in r.extra] for n in lengths]
            if any(kept):  # token drop: the measured retention, mean over the prompts
                lines.append(f"| {engine} | retention ρ | " + " | ".join(
                    f"{sum(k) / len(k):.3f}" if k else "" for k in kept) + " |")
        return "\n".join(lines)


def _tokenizer_key(tokenizer) -> tuple:
    """Engines whose tokenizers agree on this share one set of prompts."""
    probe = "RULER probe: The grass is green. VAR ABCDE = 12345 <|im_start|> 1. word"
    return len(tokenizer), tuple(encode(tokenizer, probe)), getattr(tokenizer, "chat_template", None)


def run_ruler(engines: list[str], cfg: RulerConfig, device: str | None = None, log=print,
              **llm_kwargs) -> RulerResult:
    from infhip import SamplingParams

    records, infos, prompt_sets = [], {}, {}
    for engine in engines:
        llm, name = load_llm(engine, device, **llm_kwargs), engine_name(engine)
        infos[name] = engine_info(llm)
        for length in cfg.lengths:
            check_fits(llm, length)
        key = _tokenizer_key(llm.tokenizer)
        if key not in prompt_sets:
            t0 = time.perf_counter()
            prompt_sets[key] = ruler_prompts(llm.tokenizer, cfg.tasks, cfg.lengths, cfg.samples, cfg.seed, cfg.template)
            log(f"ruler: {len(prompt_sets[key])} prompts generated in {time.perf_counter() - t0:.1f} s")
        prompts = prompt_sets[key]
        for length in cfg.lengths:
            for task in cfg.tasks:
                batch = [p for p in prompts if (p.length, p.task) == (length, task)]
                t0 = time.perf_counter()
                outs = llm.generate(prompt_token_ids=[p.ids for p in batch], sampling_params=[
                    SamplingParams(max_tokens=min(p.max_new_tokens, cfg.max_new_tokens or p.max_new_tokens),
                                   temperature=0.0) for p in batch])
                share = (time.perf_counter() - t0) / len(batch)  # each prompt's share of its batch's wall time
                for p, out in zip(batch, outs):
                    extra = {"answers": p.answers, "prediction": out.text, "prompt_tokens": len(p.ids),
                             "haystack_size": p.size, "prompt_sha256": _sha(p.text), "seconds": share}
                    if llm.runner.transforms["token_drop"].cfg is not None:
                        extra["retention"] = _retention(llm, out.request_id)
                    records.append(Record("ruler", name, length, score_prediction(out.text, p.answers, p.metric),
                                          metric="ruler", sample=p.sample, variant=task, extra=extra))
                mean = sum(r.score for r in records[-len(batch):]) / len(batch)
                log(f"ruler {name} {length} {task}: {mean:.1f} ({len(batch)} prompts, "
                    f"{time.perf_counter() - t0:.1f} s)")
    # Each prompt's text once (engines with one tokenizer share them); records name theirs by hash.
    texts = {_sha(p.text): p.text for ps in prompt_sets.values() for p in ps}
    return RulerResult("ruler", {
        "lengths": cfg.lengths, "tasks": cfg.tasks, "samples": cfg.samples, "seed": cfg.seed,
        "template": cfg.template, "engines": engines, "engine_info": infos, "prompts": texts}, records)


def _retention(llm, seq_id: int) -> float:
    """Token drop's measured retention of a finished prompt: the mean over anchor layers of the
    share of its tokens each kept (runner.transforms["token_drop"].stats.retention; 1.0 when it dropped nothing)."""
    per_anchor = llm.runner.transforms["token_drop"].stats.retention.get(seq_id, {})
    return sum(kept / total for kept, total in per_anchor.values()) / len(per_anchor) if per_anchor else 1.0


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
