"""RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?"): its 13 synthetic tasks, generated with the engine's tokenizer and scored as RULER
scores them.

    infhip-eval ruler --engine E --tasks niah_single_1,vt,cwe,fwe,qa_1 --lengths 8k,16k --samples 4

Our own code, written from the task definitions, templates and generators that
`nvidia-long-context-eval` 26.3 ships (`long_context_eval/synthetic.yaml`, `data/synthetic/*.py`,
`data/synthetic/constants.py`, `eval/synthetic/constants.py`), and reading only its data files
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

import functools
import hashlib
import importlib.util
import json
import os
import random
import re
import string
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from infhip.eval.common import EvalError, check_fits, engine_info, engine_name, load_llm
from infhip.eval.prompts import encode, special_prefix
from infhip.eval.results import EvalResult, Record
from infhip.eval.text import NOISE_SENTENCES, TextUnavailable, pg_text, ruler_data_file


@dataclass(frozen=True)
class Kind:
    """One of RULER's task families (data/synthetic/constants.py, eval/synthetic/constants.py)."""

    tokens_to_generate: int
    template: str  # with {context} and {query} (and NIAH's {type_needle_v})
    answer_prefix: str
    metric: str  # "all" (string_match_all) | "part" (string_match_part)


KINDS = {
    "niah": Kind(128, "Some special magic {type_needle_v} are hidden within the following text. Make sure to "
                      "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all "
                      "the special magic {type_needle_v} for {query} mentioned in the provided text?",
                 " The special magic {type_needle_v} for {query} mentioned in the provided text are", "all"),
    "variable_tracking": Kind(30, "Memorize and track the chain(s) of variable assignment hidden in the following "
                                  "text.\n\n{context}\nQuestion: Find all variables that are assigned the value "
                                  "{query} in the text above.",
                              " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
                              "variables are assgined the value {query}, they are: ", "all"),
    "common_words_extraction": Kind(120, "Below is a numbered list of words. In these words, some appear more often "
                                         "than others. Memorize the ones that appear most often.\n{context}\n"
                                         "Question: What are the 10 most common words in the above list?",
                                    " Answer: The top 10 words that appear most often in the list are:", "all"),
    "freq_words_extraction": Kind(50, "Read the following coded text and track the frequency of each coded word. "
                                      "Find the three most frequently appeared coded words. {context}\nQuestion: Do "
                                      "not provide any explanation. Please ignore the dots '....'. What are the "
                                      "three most frequently appeared words in the above coded text?",
                                  " Answer: According to the coded text above, the three most frequently appeared "
                                  "words are:", "all"),
    "qa": Kind(32, "Answer the question based on the given documents. Only give me the answer and do not output any "
                   "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on "
                   "the given documents. Only give me the answer and do not output any other words.\n\nQuestion: "
                   "{query}", " Answer:", "part"),
}


def _niah(haystack: str, k: str, v: str, num_k: int = 1, num_v: int = 1, num_q: int = 1) -> tuple[str, dict]:
    return "niah", {"haystack": haystack, "type_k": k, "type_v": v, "num_k": num_k, "num_v": num_v, "num_q": num_q}


# RULER's synthetic.yaml: task -> (kind, arguments)
TASKS = {
    "niah_single_1": _niah("repeat", "words", "numbers"),
    "niah_single_2": _niah("essay", "words", "numbers"),
    "niah_single_3": _niah("essay", "words", "uuids"),
    "niah_multikey_1": _niah("essay", "words", "numbers", num_k=4),
    "niah_multikey_2": _niah("needle", "words", "numbers"),
    "niah_multikey_3": _niah("needle", "uuids", "uuids"),
    "niah_multivalue": _niah("essay", "words", "numbers", num_v=4),
    "niah_multiquery": _niah("essay", "words", "numbers", num_q=4),
    "vt": ("variable_tracking", {"num_chains": 1, "num_hops": 4}),
    "cwe": ("common_words_extraction", {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10}),
    "fwe": ("freq_words_extraction", {"alpha": 2.0}),
    "qa_1": ("qa", {"dataset": "squad"}),
    "qa_2": ("qa", {"dataset": "hotpotqa"}),
}
TEMPLATES = ("base", "chat")
NIAH_DEPTHS = [round(100 * i / 39) for i in range(40)]  # np.linspace(0, 100, 40) rounded, as RULER
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
VT_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
VT_ICL_LENGTH = 500  # RULER's one-shot VT example is fitted to 500 tokens
WONDERWORDS_PIP = "pip install wonderwords==3.0.1"


# ------------------------------------------------------------------------------ data

def _wonderwords_file(name: str) -> Path:
    spec = importlib.util.find_spec("wonderwords")
    if spec is None or not spec.submodule_search_locations:
        raise TextUnavailable(f"RULER's word lists need `{WONDERWORDS_PIP}`")
    path = Path(list(spec.submodule_search_locations)[0]) / "assets" / name
    if not path.is_file():
        raise TextUnavailable(f"{path} is missing: reinstall with `{WONDERWORDS_PIP} --force-reinstall`")
    return path


@functools.lru_cache(maxsize=None)
def word_list(kind: str) -> tuple[str, ...]:
    """wonderwords' `nounlist.txt`, `adjectivelist.txt` or `verblist.txt`: one word a line."""
    return tuple(w.rstrip() for w in _wonderwords_file(f"{kind}list.txt").read_text().splitlines())


@functools.lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """The PG essays as RULER's NIAH haystack: whitespace-split words."""
    return tuple(pg_text().split(" "))


_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Sentences of running text: a split after ./!/? (and closing quotes) before a capital or digit.

    >>> split_sentences('He said "Go." Then he left. It was 5 p.m. so late! 3 went.')
    ['He said "Go."', 'Then he left.', 'It was 5 p.m. so late!', '3 went.']
    """
    return [s for s in (m.strip() for m in _split_keep(text)) if s]


def _split_keep(text: str) -> list[str]:
    out, last = [], 0
    for m in _SENTENCE_END.finditer(text):
        out.append(text[last:m.end()])
        last = m.end()
    return out + [text[last:]]


@functools.lru_cache(maxsize=2)
def qa_data(dataset: str) -> tuple[tuple[dict, ...], tuple[str, ...]]:
    """(questions, documents) as RULER's read_squad / read_hotpotqa build them: documents sorted
    and deduplicated; a question has its `outputs`, its `context` document indices and, for
    SQuAD, `more_context` (the other paragraphs of its article). SQuAD's unanswerable ones are
    left out."""
    data = json.loads(ruler_data_file(f"{dataset}.json").read_text())
    if dataset == "squad":
        docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
        index = {c: i for i, c in enumerate(docs)}
        qas = []
        for d in data["data"]:
            article = [index[p["context"]] for p in d["paragraphs"]]
            for p in d["paragraphs"]:
                own = index[p["context"]]
                qas += [{"query": q["question"], "outputs": [a["text"] for a in q["answers"]], "context": [own],
                         "more_context": [i for i in article if i != own]}
                        for q in p["qas"] if not q["is_impossible"]]
        return tuple(qas), tuple(docs)
    docs_of = [[f"{t}\n{''.join(p)}" for t, p in d["context"]] for d in data]
    docs = sorted({doc for ds in docs_of for doc in ds})
    index = {c: i for i, c in enumerate(docs)}
    qas = [{"query": d["question"], "outputs": [d["answer"]], "context": [index[c] for c in ds], "more_context": []}
           for d, ds in zip(data, docs_of)]
    return tuple(qas), tuple(docs)


# ------------------------------------------------------------------------------ generators
# Each returns (prompt body: the task template filled in, the answer prefix filled in, the
# references) for a haystack size n, drawing from `rng` only.

@dataclass(frozen=True)
class Ctx:
    """What a generator needs besides n and rng."""

    args: dict
    seed: int
    length: int
    sample: int
    vt_icl: str = ""  # VT: the one-shot example (prompt + answer), before its names are renamed


def _random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "words":
        return f"{rng.choice(word_list('adjective'))}-{rng.choice(word_list('noun'))}"
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def gen_niah(rng: random.Random, n: int, ctx: Ctx) -> tuple[str, str, list[str]]:
    a = ctx.args
    num_k = max(a["num_k"], a["num_q"])
    keys, values, needles = [], [], []
    for _ in range(num_k):
        keys.append(_random_value(rng, a["type_k"]))
        values.append([_random_value(rng, a["type_v"]) for _ in range(a["num_v"])])
        needles += [NEEDLE.format(type_needle_v=a["type_v"], key=keys[-1], value=v) for v in values[-1]]
    random.Random(ctx.seed).shuffle(needles)
    if a["haystack"] == "essay":
        sentences = split_sentences(" ".join(essay_words()[:n]))
        cuts = [0] + sorted(int(len(sentences) * d / 100) for d in rng.sample(NIAH_DEPTHS, len(needles))) \
            + [len(sentences)]
        pieces = []
        for i in range(1, len(cuts)):
            pieces.append(" ".join(sentences[cuts[i - 1]:cuts[i]]))
            if i - 1 < len(needles):
                pieces.append(needles[i - 1])
        context = " ".join(pieces)
    else:
        if a["haystack"] == "repeat":
            lines = [NOISE_SENTENCES.strip()] * n
        else:  # "needle": the haystack is needles of other keys
            lines = [NEEDLE.format(type_needle_v=a["type_v"], key=_random_value(rng, a["type_k"]),
                                   value=_random_value(rng, a["type_v"])) for _ in range(n)]
        for index, needle in zip(sorted(rng.sample(range(n), len(needles)), reverse=True), needles):
            lines.insert(index, needle)
        context = "\n".join(lines)
    asked = rng.sample(range(num_k), a["num_q"])
    queries = [keys[i] for i in asked]
    answers = [v for i in asked for v in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    kind, type_v = KINDS["niah"], a["type_v"]
    template, prefix = kind.template, kind.answer_prefix
    if a["num_q"] * a["num_v"] == 1:  # RULER's singular wording, by the same string replacements
        template, prefix = (_singular(t) for t in (template, prefix))
        type_v = type_v[:-1]
    fill = {"type_needle_v": type_v, "context": context, "query": query}
    return template.format(**fill), prefix.format(**fill), answers


def _singular(t: str) -> str:
    return t.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")


def _vt_chain(rng: random.Random, num_hops: int, letters: int) -> tuple[list[str], list[str]]:
    names: list[str] = []
    while len(names) < num_hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    chain = [f"VAR {names[0]} = {rng.randint(10000, 99998)}"]  # numpy's randint(10000, 99999): high exclusive
    chain += [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(num_hops)]
    return names, chain


def _vt_text(rng: random.Random, n: int, num_hops: int, letters: int) -> tuple[str, str, list[str]]:
    names, chain = _vt_chain(rng, num_hops, letters)
    lines = [VT_NOISE] * n
    for j, pos in enumerate(sorted(rng.sample(range(n), len(chain)))):
        lines.insert(pos + j, chain[j])
    context = " ".join(lines).replace(". \n", ".\n")
    kind = KINDS["variable_tracking"]
    fill = {"context": context, "query": chain[0].split("=")[-1].strip(), "num_v": num_hops + 1}
    return kind.template.format(**fill), kind.answer_prefix.format(**fill), names


def gen_vt(rng: random.Random, n: int, ctx: Ctx) -> tuple[str, str, list[str]]:
    body, prefix, names = _vt_text(rng, n, ctx.args["num_hops"], letters=5)
    return " " + _rename_icl_answers(rng, ctx.vt_icl) + "\n\n" + body, prefix, names


def vt_icl_example(rng: random.Random, n: int, num_hops: int) -> str:
    """RULER's one-shot VT example: 3-letter names, at most 10 hops, its answer after the prompt."""
    body, prefix, names = _vt_text(rng, n, min(10, num_hops), letters=3)
    return body + prefix + " " + " ".join(names) + "\n\n"


def _rename_icl_answers(rng: random.Random, icl: str) -> str:
    """RULER's randomize_icl: each answer name of the example becomes random letters everywhere."""
    cut = icl.index(KINDS["variable_tracking"].answer_prefix[-10:])
    for name in icl[cut + 10:].strip().split():
        icl = icl.replace(name, "".join(rng.choices(string.ascii_uppercase, k=len(name))))
    return icl


def _cwe_list(rng: random.Random, seed: int, num_words: int, repeats: int, uncommon_repeats: int,
              num_common: int) -> tuple[str, list[str]]:
    chosen = rng.sample(_cwe_vocabulary(seed), num_words)
    common, uncommon = chosen[:num_common], chosen[num_common:]
    words = common * repeats + uncommon * uncommon_repeats
    random.Random(seed).shuffle(words)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words)), common


@functools.lru_cache(maxsize=4)
def _cwe_vocabulary(seed: int) -> list[str]:
    words = sorted(set(word_list("noun") + word_list("adjective") + word_list("verb")))
    random.Random(seed).shuffle(words)
    return words


def gen_cwe(rng: random.Random, n: int, ctx: Ctx) -> tuple[str, str, list[str]]:
    a, kind = ctx.args, KINDS["common_words_extraction"]
    if ctx.length < 4096:  # RULER's smaller example and repeat counts below 4K
        example, example_answer = _cwe_list(rng, ctx.seed, 20, 3, 1, a["num_cw"])
        context, answer = _cwe_list(rng, ctx.seed, n, 6, 1, a["num_cw"])
    else:
        example, example_answer = _cwe_list(rng, ctx.seed, 40, 10, 3, a["num_cw"])
        context, answer = _cwe_list(rng, ctx.seed, n, a["freq_cw"], a["freq_ucw"], a["num_cw"])
    shown = kind.template.format(context=example, query="") + kind.answer_prefix + \
        " ".join(f"{i + 1}. {w}" for i, w in enumerate(example_answer))  # (no space after the prefix: as RULER)
    return shown + "\n" + kind.template.format(context=context, query=""), kind.answer_prefix, answer


def _zeta(s: float) -> float:
    """Riemann zeta for s > 1 (Euler-Maclaurin after 100 terms: error far below 1e-12)."""
    n = 100
    return sum(k ** -s for k in range(1, n)) + n ** (1 - s) / (s - 1) + n ** -s / 2 + s * n ** (-s - 1) / 12


def gen_fwe(rng: random.Random, n: int, ctx: Ctx) -> tuple[str, str, list[str]]:
    vocab_size = ctx.length // 50  # RULER's default vocabulary size
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    ranked = sorted(vocab)
    random.Random(ctx.seed).shuffle(ranked)
    ranked[0] = "..."  # the most frequent "word" is noise
    alpha = ctx.args["alpha"]
    words = [w for k, w in enumerate(ranked, 1) for _ in range(int(n * k ** -alpha / _zeta(alpha)))]
    random.Random(ctx.seed).shuffle(words)
    kind = KINDS["freq_words_extraction"]
    return kind.template.format(context=" ".join(words), query=""), kind.answer_prefix, ranked[1:4]


def gen_qa(rng: random.Random, n: int, ctx: Ctx) -> tuple[str, str, list[str]]:
    qas, docs = qa_data(ctx.args["dataset"])
    qa = qas[ctx.sample % len(qas)]  # RULER: sample i asks question i
    own, more = list(qa["context"]), list(qa["more_context"])
    if n < len(docs):
        if n - len(own) > len(more):
            taken = set(own + more)
            others = [i for i in range(len(docs)) if i not in taken]
            chosen = own + more + rng.sample(others, max(0, n - len(own) - len(more)))
        else:
            chosen = own + rng.sample(more, n - len(own))
        shown = [docs[i] for i in chosen]
    else:
        shown = list(docs)
    random.Random(ctx.seed).shuffle(shown)
    context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(shown))
    kind = KINDS["qa"]
    return kind.template.format(context=context, query=qa["query"]), kind.answer_prefix, list(qa["outputs"])


GENERATORS: dict[str, Callable[[random.Random, int, Ctx], tuple[str, str, list[str]]]] = {
    "niah": gen_niah, "variable_tracking": gen_vt, "common_words_extraction": gen_cwe,
    "freq_words_extraction": gen_fwe, "qa": gen_qa}


def size_range(task: str, ctx: Ctx) -> tuple[int, int]:
    """Smallest and largest haystack size n of a task (the largest: what the data holds)."""
    kind, a = TASKS[task]
    if kind == "niah":
        needles = max(a["num_k"], a["num_q"]) * a["num_v"]
        return (needles, len(essay_words())) if a["haystack"] == "essay" else (needles, 10 ** 7)
    if kind == "variable_tracking":
        return a["num_hops"] + 1, 10 ** 7
    if kind == "common_words_extraction":
        return a["num_cw"] + 1, len(_cwe_vocabulary(ctx.seed))
    if kind == "freq_words_extraction":
        return 100, 10 ** 8  # from 100 words the ranks 2-5 have distinct counts
    qa = qa_data(a["dataset"])
    return len(qa[0][ctx.sample % len(qa[0])]["context"]), len(qa[1])


# ------------------------------------------------------------------------------ prompts

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

    def __post_init__(self) -> None:
        bad = [t for t in self.tasks if t not in TASKS]
        if bad or not self.tasks:
            raise EvalError(f"unknown RULER tasks {bad}; choose from {', '.join(TASKS)}")
        if self.samples < 1 or self.template not in TEMPLATES:
            raise EvalError(f"samples must be >= 1 and template one of {', '.join(TEMPLATES)}")


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
            if any(kept):  # UniPrefill: the measured retention, mean over the prompts
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
                    SamplingParams(max_tokens=p.max_new_tokens, temperature=0.0) for p in batch])
                for p, out in zip(batch, outs):
                    extra = {"answers": p.answers, "prediction": out.text, "prompt_tokens": len(p.ids),
                             "haystack_size": p.size, "prompt_sha256": _sha(p.text)}
                    if llm.runner.token_drop is not None:
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
    """UniPrefill's measured retention of a finished prompt: the mean over anchor layers of the
    share of its tokens each kept (ModelRunner.drop_stats.retention; 1.0 when it dropped nothing)."""
    per_anchor = llm.runner.drop_stats.retention.get(seq_id, {})
    return sum(kept / total for kept, total in per_anchor.values()) / len(per_anchor) if per_anchor else 1.0


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
