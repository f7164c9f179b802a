"""Structured output through the Python API (runtime/structured_output.py) on the tiny engine:
its random weights at temperature 1 would write anything, so every constraint shows in the
output. JSON schema output parses and matches the schema for several seeds; JSON mode gives an
object; regex and choice are obeyed; n forks each follow the grammar; a grammar the library
refuses is the request's ValueError; rows without a grammar sample exactly as they would alone,
and an engine that never sees a grammar never builds one. Over HTTP and with the openai
client: tests/test_structured_output_server.py."""

from __future__ import annotations

import json
import re

import pytest

from infhip import LLM, SamplingParams, StructuredOutputsParams
from infhip.runtime.structured_output import choice_regex
from tests._tiny import API_ENGINE

SCHEMA = {
    "type": "object",
    "properties": {
        "word": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
    },
    "required": ["word", "n", "ok", "tags"],
}
SEEDS = range(6)


def matches_schema(obj) -> bool:
    """SCHEMA's rules, checked by hand (jsonschema is not a dependency)."""
    return (isinstance(obj, dict) and set(obj) == set(SCHEMA["required"])
            and isinstance(obj["word"], str) and len(obj["word"]) <= 6
            and type(obj["n"]) is int and 0 <= obj["n"] <= 999 and isinstance(obj["ok"], bool)
            and isinstance(obj["tags"], list) and len(obj["tags"]) <= 3
            and all(t in ("a", "bb", "ccc") for t in obj["tags"]))


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine(**{**API_ENGINE, "max_batch_size": 8})


@pytest.fixture(scope="module")
def llm(engine):
    return LLM(engine)


def constrained(llm, spec: StructuredOutputsParams, seeds=SEEDS, max_tokens: int = 80, **kw):
    """One temperature-1 request per seed under spec, batched; their outputs."""
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=s, structured_outputs=spec, **kw)
              for s in seeds]
    return llm.generate(["In the beginning"] * len(params), params)


def test_json_schema_output_parses_and_matches(llm):
    outs = constrained(llm, StructuredOutputsParams(json=SCHEMA))
    for o in outs:
        assert o.finish_reason == "stop", o.text
        assert matches_schema(json.loads(o.text)), o.text
    assert len({o.text for o in outs}) > 1  # the seeds differ: the grammar constrains, it does not pick


def test_json_object_mode(llm):
    # Free JSON lets random weights write one endless key; a bias toward '"' and '}' ends strings
    # and objects sooner, and only where the grammar allows them (the output must still parse).
    bias = {t: 4.0 for t in llm.tokenizer.convert_tokens_to_ids(['"', "}"])}
    outs = constrained(llm, StructuredOutputsParams(json_object=True), max_tokens=100, logit_bias=bias)
    for o in outs:
        assert o.finish_reason == "stop", o.text
        assert isinstance(json.loads(o.text), dict), o.text


def test_regex_and_choice(llm):
    pattern = r"[a-c]{2}\d{1,3}(x|yz)"
    for o in constrained(llm, StructuredOutputsParams(regex=pattern)):
        assert o.finish_reason == "stop" and re.fullmatch(pattern, o.text), o.text
    choices = ["yes", "no", "a.b (c)", "maybe not"]  # regex metacharacters are literal
    outs = constrained(llm, StructuredOutputsParams(choice=choices), seeds=range(12))
    assert all(o.finish_reason == "stop" and o.text in choices for o in outs), [o.text for o in outs]
    assert len({o.text for o in outs}) > 1
    assert re.fullmatch(choice_regex(choices), "a.b (c)") and not re.fullmatch(choice_regex(choices), "a-b (c)")


def test_n_forks_each_follow_the_grammar(llm):
    p = SamplingParams(max_tokens=20, temperature=1.0, seed=3, n=3,
                       structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue"]))
    [out] = llm.generate(["In the beginning"], p)
    assert len(out.outputs) == 3 and all(c.text in ("red", "green", "blue") for c in out.outputs)


def test_bad_grammar_is_a_value_error_and_queues_nothing(llm):
    for spec, needle in ((StructuredOutputsParams(regex="(unclosed"), "regex grammar does not compile"),
                         (StructuredOutputsParams(grammar="root ::= undefined_rule"), "grammar grammar does not compile")):
        with pytest.raises(ValueError, match=needle):
            llm.generate(["x"], SamplingParams(structured_outputs=spec))
        view = llm.debug_view()
        assert (view["requests"], view["running"], view["waiting"]) == ({}, [], [])
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="not JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputsParams(choice=[])


def test_rows_without_a_grammar_pay_nothing(engine, monkeypatch):
    fresh = LLM(engine)
    plain = [SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True) for s in (7, 8)]
    alone = [o.token_ids for o in fresh.generate(["In the beginning"] * 2, plain)]
    assert not fresh.debug_view()["grammar_compiler"]  # no grammar request: the compiler was never built
    spec = StructuredOutputsParams(json=SCHEMA)
    mixed = fresh.generate(["In the beginning"] * 3,
                           plain + [SamplingParams(max_tokens=80, temperature=1.0, seed=1, structured_outputs=spec)])
    assert [o.token_ids for o in mixed[:2]] == alone  # their rows are all-ones in the bitmask
    assert matches_schema(json.loads(mixed[2].text))
    batches, sample = [], fresh.core.sampler.sample  # the batches the sampler gets from now on
    monkeypatch.setattr(fresh.core.sampler, "sample", lambda logits, batch: batches.append(batch) or sample(logits, batch))
    assert fresh.debug_view()["grammar_compiler"]
    assert [o.token_ids for o in fresh.generate(["In the beginning"] * 2, plain)] == alone
    # batches without grammar rows get no bitmask, though the compiler exists now
    assert batches and all(b.token_bitmask is None and not b.host_each_step for b in batches)


def test_back_to_back_decode_steps_under_a_grammar_equal_single_steps(engine, llm):
    """num_decode_steps 4 (the GPU default's path, eagerly here): grammar rows run back-to-back
    steps, their matchers advanced between the steps from each step's tokens on the host (next
    to a plain row and a penalized one); every output equals one step at a time and parses."""
    multi = LLM(engine, num_decode_steps=4)
    runs, run = [], multi.runner.execute_decode_steps
    multi.runner.execute_decode_steps = lambda out, k, sample: runs.append(k) or run(out, k, sample)
    spec = StructuredOutputsParams(json=SCHEMA)
    params = [SamplingParams(max_tokens=80, temperature=1.0, seed=s, structured_outputs=spec) for s in (0, 1)]
    params += [SamplingParams(max_tokens=30, temperature=1.0, seed=5, ignore_eos=True),
               SamplingParams(max_tokens=30, temperature=0, frequency_penalty=0.5,
                              structured_outputs=StructuredOutputsParams(regex=r"[a-c]{5,40}"))]
    one = llm.generate(["In the beginning"] * 4, params)
    four = multi.generate(["In the beginning"] * 4, params)
    assert runs and set(runs) == {4}  # the back-to-back path ran, grammar rows in it
    assert [o.token_ids for o in four] == [o.token_ids for o in one]
    for o in four[:2]:
        assert o.finish_reason == "stop" and matches_schema(json.loads(o.text)), o.text
    assert re.fullmatch(r"[a-c]{5,40}", four[3].text), four[3].text
