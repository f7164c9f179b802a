"""Tool calls (runtime/serving/tool_calls.py) without a model: the hermes (Qwen2.5) and
llama3_json parsers on whole answers, the streaming parser fed every split of an answer gives
what the whole parse gives, the plans of each tool_choice and the errors of bad ones. Through
the server and the openai client: tests/test_structured_output_server.py."""

from __future__ import annotations

import json
import random

import pytest

from infhip.runtime.serving.tool_calls import (HERMES, LLAMA3, ToolCallPlan, detect_format, parse_hermes,
                                               parse_llama3, template_messages)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
QWEN_TEMPLATE = "{% if tools %}... <tool_call>\n{\"name\": ...}\n</tool_call>{% endif %}"
LLAMA_TEMPLATE = "{% if tools %}{\"name\": function name, \"parameters\": ...}<|python_tag|>{% endif %}"


def calls_of(calls: list[dict]) -> list[tuple[str, dict]]:
    """(name, arguments as an object) of OpenAI tool calls, checking their shape."""
    out = []
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_") and set(c["function"]) == {"name", "arguments"}
        out.append((c["function"]["name"], json.loads(c["function"]["arguments"])))
    return out


HERMES_CASES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris"})]),
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me look.", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("No tools needed: <b>4</b>.", "No tools needed: <b>4</b>.", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}', None, [("get_weather", {"city": "Rome"})]),
    ("<tool_call>\nnot json\n</tool_call> done", "<tool_call>\nnot json\n</tool_call> done", []),
    # blanks next to a call go, other text stays where it was
    (' Hi \n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n then bye \n', " Hithen bye",
     [("get_time", {})]),
    ('a <tool_call>x</tool_call> \n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     "a <tool_call>x</tool_call>", [("get_time", {})]),
]
LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}; {"name": "get_time", "parameters": {}}',
     None, [("get_weather", {"city": "Lima"}), ("get_time", {})]),
    ("The answer is {not a call}.", "The answer is {not a call}.", []),
    ('{"name": "get_weather", "parameters": {"city": "Pa', '{"name": "get_weather", "parameters": {"city": "Pa', []),
]


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes_parse(text, content, calls):
    got_content, got_calls = parse_hermes(text)
    assert got_content == content and calls_of(got_calls) == calls


@pytest.mark.parametrize("text, content, calls", LLAMA_CASES)
def test_llama3_parse(text, content, calls):
    got_content, got_calls = parse_llama3(text)
    assert got_content == content and calls_of(got_calls) == calls


def streamed(plan: ToolCallPlan, pieces: list[str]) -> tuple[str, list[dict]]:
    """(content, calls) as a client assembles them from the stream's deltas (OpenAI's rule: a
    delta item with an index not seen yet opens a call, later ones append to its arguments)."""
    stream, content, calls = plan.stream(), [], {}
    for out in [stream.feed(p) for p in pieces] + [stream.finish()]:
        text, items = out
        content.append(text)
        for it in items:
            if it["index"] not in calls:
                assert it["id"].startswith("call_") and it["type"] == "function" and it["function"]["name"]
                calls[it["index"]] = {"id": it["id"], "type": "function", "function": dict(it["function"])}
            else:
                calls[it["index"]]["function"]["arguments"] += it["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return "".join(content), [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("fmt, cases", [(HERMES, HERMES_CASES), (LLAMA3, LLAMA_CASES)])
def test_stream_equals_whole_parse_at_every_split(fmt, cases):
    plan = ToolCallPlan([WEATHER, TIME], fmt)
    rng = random.Random(0)
    for text, content, calls in cases:
        splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
        for _ in range(20):  # and a few random many-piece splits
            cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
            splits.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
        for pieces in splits:
            got_content, got_calls = streamed(plan, pieces)
            assert (got_content or None) == content, pieces
            assert calls_of(got_calls) == calls, pieces


def test_hermes_call_streams_its_arguments_as_they_grow():
    """Qwen2.5's output fed a few characters at a time: the call opens with its name once the
    head has come, its arguments follow in several pieces, none is the block's own `}`."""
    plan = ToolCallPlan([WEATHER, TIME], HERMES)
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
    stream, out = plan.stream(), []
    for i in range(0, len(text), 3):
        out.append(stream.feed(text[i:i + 3]))
    out.append(stream.finish())
    items = [it for _, its in out for it in its]
    head, *rest = items
    assert head["function"] == {"name": "get_weather", "arguments": ""} and head["index"] == 0
    pieces = [it["function"]["arguments"] for it in rest]
    assert len(pieces) >= 5 and all(set(it) == {"index", "function"} and it["index"] == 0 for it in rest)
    assert "".join(pieces) == '{"city": "Paris", "unit": "C"}'
    assert "".join(c for c, _ in out) == "Sure."


def test_named_function_streams_its_arguments():
    plan = ToolCallPlan.of([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert plan.structured_outputs.json == WEATHER["function"]["parameters"]
    content, calls = streamed(plan, ['{"ci', 'ty": "Par', 'is"}'])
    assert content == "" and calls_of(calls) == [("get_weather", {"city": "Paris"})]
    assert calls_of(plan.parse('{"city": "Paris"}')[1]) == [("get_weather", {"city": "Paris"})]
    assert plan.finish_reason(calls, "stop") == "stop"  # OpenAI: a named choice finishes with "stop"


def test_plans_of_each_tool_choice():
    assert detect_format(QWEN_TEMPLATE) == HERMES and detect_format(LLAMA_TEMPLATE) == LLAMA3
    assert detect_format("{{ messages }}") is None
    assert ToolCallPlan.of(None, None, QWEN_TEMPLATE) is None
    assert ToolCallPlan.of([WEATHER], "none", QWEN_TEMPLATE) is None
    auto = ToolCallPlan.of([WEATHER], None, QWEN_TEMPLATE)
    assert (auto.fmt, auto.tools, auto.structured_outputs) == (HERMES, [WEATHER], None)
    assert auto.finish_reason([{}], "stop") == "tool_calls" and auto.finish_reason([{}], "length") == "length"
    for template, fmt, begin in ((QWEN_TEMPLATE, HERMES, "<tool_call>\n{\"name\": \"get_weather\""),
                                 (LLAMA_TEMPLATE, LLAMA3, "{\"name\": \"get_weather\", \"parameters\": "),
                                 (None, HERMES, "<tool_call>")):  # no format of its own: hermes
        req = ToolCallPlan.of([WEATHER, TIME], "required", template)
        tag = req.structured_outputs.structural_tag["format"]
        assert req.fmt == fmt and tag["at_least_one"] and tag["tags"][0]["begin"].startswith(begin)
        one = ToolCallPlan.of([WEATHER, TIME], "required", template, parallel=False)  # parallel_tool_calls false
        assert one.structured_outputs.structural_tag["format"] == {"type": "or", "elements": tag["tags"]}


@pytest.mark.parametrize("tools, choice, template, needle", [
    (None, "auto", QWEN_TEMPLATE, "tool_choice needs tools"),
    ([WEATHER], "auto", None, "does not render tools"),
    ([WEATHER], "sometimes", QWEN_TEMPLATE, "tool_choice must be"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, QWEN_TEMPLATE, "get_weather"),
    ([{"type": "function", "function": {"description": "no name"}}], "auto", QWEN_TEMPLATE, "tools[0]"),
    ([{"type": "retrieval"}], "auto", QWEN_TEMPLATE, "tools[0]"),
])
def test_bad_tools_say_what_to_send(tools, choice, template, needle):
    with pytest.raises(ValueError, match=None) as e:
        ToolCallPlan.of(tools, choice, template)
    assert needle in str(e.value)


def test_template_messages_turn_arguments_into_objects():
    msgs = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = template_messages(msgs)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"} and out[1] == msgs[1]
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == "{\"city\": \"Paris\"}"  # not changed in place
