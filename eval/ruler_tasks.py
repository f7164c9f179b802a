"""RULER's tasks (eval/ruler.py says whose and how we differ): the task families
(`KINDS`: template, answer prefix, tokens to generate, metric), the 13 tasks (`TASKS`, RULER's
synthetic.yaml), the data they read (PG essays, SQuAD / HotpotQA, wonderwords' word lists) and
one generator per family (`GENERATORS`): (rng, haystack size n, Ctx) -> (prompt body, answer
prefix, references).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import random
import re
import string
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from infhip.eval.text import NOISE_SENTENCES, TextUnavailable, pg_text, ruler_data_file


@dataclass(frozen=True)
class Kind:
    """One of RULER's task families (data/synthetic/constants.py, long_context_eval/eval/synthetic/constants.py)."""

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
