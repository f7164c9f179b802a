"""infhip-eval text and prompt generation (no model): KJV cleaning, exact-length token windows,
passkey and RULER-style needle prompts that are deterministic per seed, result files, parsing,
and the doctests of the eval modules."""

from __future__ import annotations

import doctest
import importlib
import re

import pytest

from infhip.eval import niah, passkey, results, text
from infhip.eval.common import EvalError, parse_floats, parse_lengths
from infhip.eval.niah import VARIANTS, niah_case, niah_prompt_ids, score_answer
from infhip.eval.passkey import passkey_prompt_ids
from infhip.eval.results import EvalResult, Record
from tests._tiny import write_tiny_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer
    path = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def test_clean_verse_drops_references():
    assert text.clean_verse("1:1 In the beginning.") == "In the beginning."
    assert text.clean_verse("31:48 And Laban said;  31:49 And Mizpah") == "And Laban said; And Mizpah"
    assert text.clean_verse("12:3-4 Amen") == "Amen"


def test_kjv_text_is_clean_and_complete():
    verses = text.kjv_verses()
    assert len(verses) > 20_000
    assert verses[0].startswith("In the beginning God created")
    body = text.kjv_text()
    assert len(body) > 4_000_000
    assert not re.search(r"\d", body), "verse numbers left in the text"


@pytest.mark.parametrize("source", ["kjv", "noise"])
def test_token_window_exact_and_deterministic(tok, source):
    for n in (1, 37, 1000):
        ids = text.token_window(tok, n, source, seed=3)
        assert len(ids) == n
        assert ids == text.token_window(tok, n, source, seed=3)
    if source == "kjv":
        assert text.token_window(tok, 50, "kjv", seed=1) != text.token_window(tok, 50, "kjv", seed=2)
    with pytest.raises(ValueError, match="unknown text source"):
        text.token_window(tok, 5, "bogus")


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_passkey_prompt(tok, depth):
    ids = passkey_prompt_ids(tok, 700, depth, 48213)
    assert len(ids) == 700
    decoded = tok.decode(ids)
    assert decoded.count("48213") == 2 and decoded.endswith("The pass key is")
    hay_start, hay_end = len(passkey.INTRO), len(decoded) - len(passkey.QUESTION)
    pos = (decoded.index("48213") - hay_start) / (hay_end - hay_start)
    assert abs(pos - depth) < 0.1
    with pytest.raises(ValueError, match="cannot hold"):
        passkey_prompt_ids(tok, 20, depth, 48213)


@pytest.mark.parametrize("variant", VARIANTS)
def test_niah_deterministic_per_seed(tok, variant):
    a = niah_case(variant, seed=0, length=600, depth=0.3, sample=1)
    assert a == niah_case(variant, seed=0, length=600, depth=0.3, sample=1)
    assert a != niah_case(variant, seed=1, length=600, depth=0.3, sample=1)
    for haystack in ("kjv", "noise"):
        ids = niah_prompt_ids(tok, a, 600, haystack)
        assert len(ids) == 600 and ids == niah_prompt_ids(tok, a, 600, haystack)
        decoded = tok.decode(ids)
        for value in a.answers:
            assert str(value) in decoded
        assert decoded.count("special magic number") >= len(a.needles)
    expected_needles = {"single": 1, "multikey": 4, "multivalue": 4, "multiquery": 4}[variant]
    assert len(a.needles) == expected_needles
    answer = " " + ", ".join(str(v) for v in a.answers)
    assert score_answer(a, answer) == 1.0
    assert score_answer(a, " 12") == 0.0


def test_niah_scoring_partial_and_distractors():
    mv = niah_case("multivalue", 0, 1000, 0.5, 0)
    assert score_answer(mv, f" {mv.answers[0]} and {mv.answers[2]}") == 0.5
    mk = niah_case("multikey", 0, 1000, 0.5, 0)
    distractor = re.search(r"is: (\d+)", mk.needles[1][1]).group(1)
    assert score_answer(mk, f" {distractor}") == 0.0
    with pytest.raises(EvalError, match="unknown niah variant"):
        niah_case("bogus", 0, 1000, 0.5, 0)


def test_parsing_and_results_roundtrip(tmp_path):
    assert parse_lengths("1k, 2k,16K,300") == [1024, 2048, 16384, 300]
    for bad in ("", "0", "-1k", "abc"):
        with pytest.raises(EvalError):
            parse_lengths(bad)
    with pytest.raises(EvalError):
        parse_floats("0.5,1.5", "depths", 0, 1)
    r = EvalResult("ppl", {"lengths": [64]}, [Record("ppl", "e", 64, 4.0, metric="ppl"),
                                               Record("ppl", "e", 64, 16.0, metric="ppl")])
    assert r.summary()[0]["score"] == pytest.approx(8.0)  # geometric mean = exp(mean NLL)
    back = EvalResult.load(r.save(tmp_path / "r.json"))
    assert back.records == r.records and back.markdown() == r.markdown()
    with pytest.raises(ValueError, match="non-finite"):
        Record("ppl", "e", 64, float("nan"))


def test_per_layer_recall_summary(tmp_path):
    """Recall records average per (engine, length, layer) over heads and samples; the markdown
    names each (engine, length)'s lowest layers, lowest first, and the JSON keeps the table."""
    recs = [Record("recall", e, 8192, score, metric="recall", sample=s, layer=layer, head=h)
            for e, shift in (("a", 0.0), ("b", 0.01))
            for layer in range(7) for s in range(2) for h in range(3)
            for score in [min(1.0, 0.90 + 0.01 * layer + 0.002 * h + shift)]]
    r = EvalResult("recall", {"lengths": [8192]}, recs)
    rows = r.per_layer()
    assert [(x["engine"], x["layer"]) for x in rows] == [(e, layer) for e in "ab" for layer in range(7)]
    assert rows[3]["score"] == pytest.approx(0.932) and rows[3]["n"] == 6
    text = r.markdown()
    assert "| a | 8192 | 0: 0.902, 1: 0.912, 2: 0.922, 3: 0.932, 4: 0.942 |" in text
    assert "| b | 8192 | 0: 0.912," in text and "5:" not in text.split("| a | 8192 |")[1].split("\n")[0]
    assert EvalResult.load(r.save(tmp_path / "r.json")).per_layer() == rows
    assert "per_layer" in r.to_dict() and "per_layer" not in EvalResult("ppl", {}, [
        Record("ppl", "e", 64, 4.0, metric="ppl")]).to_dict()


@pytest.mark.parametrize("module", ["text", "results", "common", "niah", "agree", "prompts", "forcing",
                                    "passkey", "ppl", "recall", "plot", "stage", "cli"])
def test_doctests(module):
    mod = importlib.import_module(f"infhip.eval.{module}")
    failures, _ = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert failures == 0
