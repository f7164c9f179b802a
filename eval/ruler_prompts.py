"""RULER prompts: a task's sample rendered with the engine's tokenizer ("base" or "chat"
template) at the largest haystack size that fits the length (`fit_size`), one `RulerPrompt`
each (eval/ruler.py runs and scores them; ruler_tasks.py generates the bodies).
"""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from infhip.eval.common import EvalError
from infhip.eval.prompts import encode, special_prefix
from infhip.eval.ruler_tasks import GENERATORS, KINDS, TASKS, VT_ICL_LENGTH, Ctx, size_range, vt_icl_example


def render(tokenizer, body: str, prefix: str, template: str) -> tuple[str, list[int]]:
    """(prompt text, token ids): "base" = body + answer prefix after the tokenizer's own prefix
    (e.g. <bos>); "chat" = the body as the user's turn of the tokenizer's chat template, the
    answer prefix opening the assistant's."""
    if template == "base":
        text = body + prefix
        return text, special_prefix(tokenizer) + encode(tokenizer, text)
    if not getattr(tokenizer, "chat_template", None):
        raise EvalError("--template chat: the engine's tokenizer has no chat template; use --template base")
    text = tokenizer.apply_chat_template([{"role": "user", "content": body}], tokenize=False,
                                         add_generation_prompt=True) + prefix
    return text, encode(tokenizer, text)


def fit_size(num_tokens: Callable[[int], int], budget: int, lo: int, hi: int, hint: int) -> int:
    """Largest n in [lo, hi] with num_tokens(n) <= budget, for a num_tokens that grows about
    linearly in n (plus a wobble of a few tokens): Newton steps with the slope through (lo,
    num_tokens(lo)), each followed, at the answer, by the neighbour that proves it the largest;
    bisection once 8 sizes were tried (or a step leaves the bracket). EvalError when even `lo`
    does not fit."""
    seen: dict[int, int] = {}

    def f(n: int) -> int:
        if n not in seen:
            seen[n] = num_tokens(n)
        return seen[n]

    if f(lo) > budget:
        raise EvalError(f"the smallest prompt of this task has {f(lo)} tokens, more than the {budget} "
                        "that the length leaves; use a longer length")
    good, bad = lo, hi + 1  # f(good) <= budget < f(bad); bad = hi + 1 (past the data) is never evaluated
    n = min(max(hint, lo + 1), hi)
    while bad - good > 1:
        if not good < n < bad or len(seen) > 8:
            n = (good + bad) // 2 if bad in seen else min(2 * good, hi)
        value = f(n)
        if value <= budget:
            good = n
        else:
            bad = n
        slope = (value - f(lo)) / (n - lo)
        n = max(int(n + (budget - value) / slope) if slope > 0 else 2 * n, good + 1)
    return good


@dataclass
class RulerPrompt:
    task: str
    length: int
    sample: int
    size: int  # the haystack size n that fills the length
    text: str
    ids: list[int]
    answers: list[str]
    max_new_tokens: int
    metric: str


def prompt_builder(tokenizer, task: str, length: int, sample: int, seed: int = 0, template: str = "base",
                   vt_icl: str = "") -> Callable[[int], tuple[str, list[int], list[str]]]:
    """n -> (prompt text, token ids, references) of one task's sample at haystack size n."""
    if task not in TASKS:
        raise EvalError(f"unknown RULER task {task!r}; choose from {', '.join(TASKS)}")
    kind_name, args = TASKS[task]
    gen, ctx = GENERATORS[kind_name], Ctx(args, seed, length, sample, vt_icl)

    def build(n: int) -> tuple[str, list[int], list[str]]:
        body, prefix, answers = gen(random.Random(f"ruler-{task}-{seed}-{length}-{sample}"), n, ctx)
        return (*render(tokenizer, body, prefix, template), answers)

    return build


def ruler_prompt(tokenizer, task: str, length: int, sample: int, seed: int = 0, template: str = "base",
                 hint: int | None = None, vt_icl: str = "") -> RulerPrompt:
    """One prompt: the task's largest haystack with prompt + tokens to generate <= length."""
    build = prompt_builder(tokenizer, task, length, sample, seed, template, vt_icl)
    kind = KINDS[TASKS[task][0]]
    lo, hi = size_range(task, Ctx(TASKS[task][1], seed, length, sample))
    budget = length - kind.tokens_to_generate
    if hint is None:  # tokens per unit of haystack, measured on a small haystack
        small = min(max(lo + 1, 64), hi)
        at_lo = len(build(lo)[1])
        per = (len(build(small)[1]) - at_lo) / max(1, small - lo)
        hint = lo + int((budget - at_lo) / per) if per > 0 else lo
    try:
        n = fit_size(lambda m: len(build(m)[1]), budget, lo, hi, hint)
    except EvalError as e:
        raise EvalError(f"RULER {task} at length {length}: {e}") from None
    text, ids, answers = build(n)
    return RulerPrompt(task, length, sample, n, text, ids, answers, kind.tokens_to_generate, kind.metric)


def vt_icl_for(tokenizer, seed: int, template: str) -> str:
    """The one-shot VT example of a run, fitted to RULER's 500 tokens (with its 30 to generate);
    the smallest example where a coarse tokenizer cannot fit one in 500."""
    num_hops = TASKS["vt"][1]["num_hops"]
    lo = num_hops + 2  # noise lines: more than the chain's 5 assignments

    def text(n: int) -> str:
        return vt_icl_example(random.Random(f"ruler-vt-icl-{seed}"), n, num_hops)

    budget = VT_ICL_LENGTH - KINDS["variable_tracking"].tokens_to_generate
    try:
        n = fit_size(lambda m: len(render(tokenizer, text(m), "", template)[1]), budget, lo, 10 ** 4, 16)
    except EvalError:
        n = lo
    return text(n)


def ruler_prompts(tokenizer, tasks: list[str], lengths: list[int], samples: int, seed: int = 0,
                  template: str = "base") -> list[RulerPrompt]:
    """Every (length, task, sample) prompt, in that order. A task's sample s+1 starts its size
    search from sample s's size; the (length, task) series run in threads (the tokenizer releases
    the GIL: a 128K prompt costs ~4 tokenizations of ~0.2 s)."""
    vt_icl = vt_icl_for(tokenizer, seed, template) if "vt" in tasks else ""

    def series(length: int, task: str) -> list[RulerPrompt]:
        out, hint = [], None
        for s in range(samples):
            out.append(ruler_prompt(tokenizer, task, length, s, seed, template, hint, vt_icl))
            hint = out[-1].size
        return out

    jobs = [(length, task) for length in lengths for task in tasks]
    with ThreadPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1)) as pool:
        return [p for ps in pool.map(lambda job: series(*job), jobs) for p in ps]
