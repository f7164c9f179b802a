"""`LLM.chat` (runtime/llm.py) renders conversations through the engine's chat template exactly
as POST /v1/chat/completions does (one renderer: runtime/chat_template.py): the same prompt
tokens and, greedy, the same completion tokens; a list of conversations gives one output each,
in order; chat_template_kwargs reach the template on both paths; bad input is a ValueError."""

from __future__ import annotations

import json

import pytest

from infhip import LLM, SamplingParams
from tests._serving import post, running_server
from tests._tiny import API_ENGINE

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
TALK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Let there be light"}]
OTHER = [{"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def llm(tiny_engine):
    return LLM(tiny_engine(**API_ENGINE))


def _http_chat(server, messages, **extra) -> tuple[list[int], list[int]]:
    """(prompt token ids from POST /tokenize, completion token ids) of the chat endpoint."""
    status, data = post(server, {"messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                                 **extra}, "/v1/chat/completions")
    assert status == 200, data
    choice = json.loads(data)["choices"][0]
    status, tok = post(server, {"messages": messages}, "/tokenize")
    assert status == 200, tok
    return json.loads(tok)["tokens"], choice["token_ids"]


def test_chat_matches_the_http_chat_endpoint(llm):
    one = llm.chat(TALK, GREEDY)
    both = llm.chat([TALK, OTHER], GREEDY)
    assert len(one) == 1 and len(both) == 2 and both[0].token_ids == one[0].token_ids
    assert one[0].prompt.endswith("<s>assistant: ")  # the template's generation prompt, as rendered text
    with running_server(llm) as server:
        for messages, out in ((TALK, both[0]), (OTHER, both[1])):
            prompt_ids, completion = _http_chat(server, messages)
            assert out.prompt_token_ids == prompt_ids
            assert out.token_ids == completion and len(completion) == 5
        # chat_template_kwargs reach the template on both paths
        kw = {"add_generation_prompt": False}
        no_turn = llm.chat(TALK, GREEDY, chat_template_kwargs=kw)[0]
        assert not no_turn.prompt.endswith("assistant: ") and no_turn.prompt_token_ids != one[0].prompt_token_ids
        status, data = post(server, {"messages": TALK, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                                     "chat_template_kwargs": kw}, "/v1/chat/completions")
        assert status == 200 and json.loads(data)["choices"][0]["token_ids"] == no_turn.token_ids


def test_chat_and_generate_share_one_path(llm):
    out = llm.chat(OTHER, GREEDY)[0]
    again = llm.generate(prompt_token_ids=[out.prompt_token_ids], sampling_params=GREEDY)[0]
    assert again.token_ids == out.token_ids
    parts = [{"role": "user", "content": [{"type": "text", "text": "The quick "}, {"type": "text", "text": "brown fox"}]}]
    assert llm.chat(parts, GREEDY)[0].prompt_token_ids == out.prompt_token_ids  # text parts, joined as the server does
    per_conversation = llm.chat([TALK, OTHER], [GREEDY, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)])
    assert [len(o.token_ids) for o in per_conversation] == [5, 2]


@pytest.mark.parametrize("messages, kwargs, match", [
    ([], {}, "chat takes one conversation"),
    ("hello", {}, "chat takes one conversation"),
    ([{"content": "no role"}], {}, "message 0 must be a dict with a string 'role'"),
    ([[{"role": "user", "content": "x"}], []], {}, "a conversation is a non-empty list"),
    (OTHER, {"chat_template_kwargs": {"tokenize": True}}, "may not set tokenize"),
])
def test_bad_chat_input_is_a_value_error(llm, messages, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, GREEDY, **kwargs)
    assert llm.stats().num_running == llm.stats().num_waiting == 0


def test_chat_needs_a_template(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(OTHER, GREEDY)
