"""infhip-serve's sampling fields (issue 33) over HTTP on the tiny engine: the request bodies
`vllm bench serve` and `sglang.bench_serving` send (pinned below from their source) are answered,
streaming and not; completions logprobs / echo / max_tokens 0 (lm-eval's loglikelihood) and chat
logprobs in OpenAI's shapes equal the engine's; n and seeds; penalties; served model names;
the chat role chunk comes with the first token."""

from __future__ import annotations

import json

import openai
import pytest

from infhip import LLM, SamplingParams
from tests._serving import error_of, post, running_server, sse_events
from tests._tiny import API_ENGINE

# vllm/benchmarks/lib/endpoint_request_func.py (vllm-project/vllm @ 02cfb534),
# async_request_openai_completions / _chat_completions with --ignore-eos, and the sampling
# flags `vllm bench serve` puts in extra_body (--temperature --top-p --top-k --min-p
# --frequency-penalty --presence-penalty --repetition-penalty).
VLLM_COMPLETIONS = {"model": "infhip", "prompt": "hello world", "repetition_penalty": 1.0, "max_tokens": 8,
                    "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
VLLM_CHAT = {"model": "infhip", "messages": [{"role": "user", "content": [{"type": "text", "text": "hello world"}]}],
             "max_completion_tokens": 8, "stream": True, "stream_options": {"include_usage": True},
             "ignore_eos": True}
VLLM_SAMPLING = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
                 "presence_penalty": 0.0, "repetition_penalty": 1.0}
# python/sglang/bench_serving.py (sgl-project/sglang @ 0033168f): async_request_openai_completions
# and async_request_openai_chat_completions ("stream": not --disable-stream).
SGLANG_COMPLETIONS = {"model": "infhip", "prompt": "hello world", "temperature": 0.0, "best_of": 1, "max_tokens": 8,
                      "stream": True, "ignore_eos": True}
SGLANG_CHAT = {"model": "infhip", "messages": [{"role": "user", "content": "hello world"}], "temperature": 0.0,
               "max_tokens": 8, "stream": True}


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine(**API_ENGINE)


@pytest.fixture(scope="module")
def reference(engine):
    return LLM(engine)


@pytest.fixture(scope="module")
def server(engine):
    with running_server(LLM(engine), model_name=["infhip", "alias"]) as srv:
        yield srv


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _chat_ids(llm, messages):
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return llm.tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("name, body", [("vllm-completions", VLLM_COMPLETIONS),
                                        ("vllm-completions-sampling", {**VLLM_COMPLETIONS, **VLLM_SAMPLING}),
                                        ("vllm-chat", VLLM_CHAT),
                                        ("vllm-chat-sampling", {**VLLM_CHAT, **VLLM_SAMPLING}),
                                        ("sglang-completions", SGLANG_COMPLETIONS), ("sglang-chat", SGLANG_CHAT)])
def test_benchmark_bodies_are_answered(server, reference, name, body, stream):
    body = {**body, "stream": stream}
    if not stream:
        body.pop("stream_options", None)
    chat = "messages" in body
    ids = _chat_ids(reference, [{"role": "user", "content": "hello world"}]) if chat else \
        reference.tokenizer("hello world")["input_ids"]
    want = reference.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=body.get("ignore_eos", False)))[0]
    status, data = post(server, body, "/v1/chat/completions" if chat else "/v1/completions")
    assert status == 200, data
    greedy = "temperature" in body  # vLLM's body without sampling flags samples at temperature 1
    if not stream:
        choice = json.loads(data)["choices"][0]
        assert (choice["message"]["content"] if chat else choice["text"]) == want.text or not greedy
        assert len(choice["token_ids"]) == len(want.token_ids)
        return
    events = sse_events(data)
    texts = [(e["choices"][0]["delta"].get("content") if chat else e["choices"][0]["text"])
             for e in events if e["choices"]]
    assert "".join(t or "" for t in texts) == want.text or not greedy
    assert sum(len(e["choices"][0]["token_ids"]) for e in events if e["choices"]) == len(want.token_ids)
    if chat:  # the role goes out with the first token, not at acceptance (TTFT of bench tools)
        first = next(e for e in events if e["choices"])["choices"][0]
        assert first["delta"]["role"] == "assistant" and first["token_ids"]
    if body.get("stream_options"):
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == len(want.token_ids)


def test_echo_logprobs_with_max_tokens_0_scores_the_prompt(server, reference):
    """lm-eval's loglikelihood request: token ids, echo, logprobs 1, max_tokens 0 (and 1: it
    drops the last entry itself)."""
    prompt = [5, 40, 41, 42, 43, 44, 45]
    want = reference.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    for max_tokens in (0, 1):
        status, data = post(server, {"model": "infhip", "prompt": [prompt], "echo": True, "logprobs": 1,
                                     "max_tokens": max_tokens, "temperature": 0, "seed": 1234})
        assert status == 200, data
        out = json.loads(data)
        lp = out["choices"][0]["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert len(lp["tokens"]) == len(prompt) + max_tokens
        for i in range(1, len(prompt)):
            rec = want.prompt_logprobs[i]
            assert lp["token_logprobs"][i] == rec.logprob
            top = lp["top_logprobs"][i]
            assert max(top.values()) == rec.top[0][1]  # lm-eval's greedy check reads this
        assert out["choices"][0]["text"].startswith(reference.tokenizer.decode(prompt))
        assert out["usage"]["completion_tokens"] == max_tokens
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_chat_logprobs_and_completions_logprobs_shapes(client, reference):
    messages = [{"role": "user", "content": "hi there"}]
    want = reference.generate(prompt_token_ids=[_chat_ids(reference, messages)], sampling_params=SamplingParams(
        max_tokens=5, temperature=0, ignore_eos=True, logprobs=2))[0]
    out = client.chat.completions.create(model="infhip", messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                         top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert [c.logprob for c in content] == [r.logprob for r in want.logprobs]
    assert [[t.logprob for t in c.top_logprobs] for c in content] == [[lp for _, lp in r.top] for r in want.logprobs]
    assert "".join(c.token for c in content) == want.text
    streamed = list(client.chat.completions.create(model="infhip", messages=messages, max_tokens=5, temperature=0,
                                                   logprobs=True, top_logprobs=2, stream=True,
                                                   extra_body={"ignore_eos": True}))
    # (a prefix-cache hit computes the tail alone: float32 noise, not equality)
    assert [c.logprob for ch in streamed if ch.choices and ch.choices[0].logprobs
            for c in ch.choices[0].logprobs.content] == pytest.approx([r.logprob for r in want.logprobs], abs=1e-5)
    comp = client.completions.create(model="alias", prompt="hi there", max_tokens=4, temperature=0, logprobs=3)
    ref = reference.generate(["hi there"], SamplingParams(max_tokens=4, temperature=0, logprobs=3))[0]
    assert comp.model == "alias" and comp.choices[0].logprobs.token_logprobs == [r.logprob for r in ref.logprobs]
    # keyed by token text: byte tokens that decode alike ("\ufffd") share a key, as in vLLM
    assert [max(t.values()) for t in comp.choices[0].logprobs.top_logprobs] == [r.top[0][1] for r in ref.logprobs]


def test_n_choices_equal_seeded_requests_and_penalties_map(client, reference):
    base = dict(max_tokens=6, temperature=1.0, ignore_eos=True)
    alone = [reference.generate(["hello"], SamplingParams(seed=21 + i, **base))[0].text for i in range(3)]
    out = client.completions.create(model="infhip", prompt="hello", n=3, seed=21, max_tokens=6, temperature=1.0,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2] and [c.text for c in out.choices] == alone
    assert out.usage.completion_tokens == 18
    chunks = list(client.completions.create(model="infhip", prompt="hello", n=3, seed=21, max_tokens=6,
                                            temperature=1.0, stream=True, extra_body={"ignore_eos": True}))
    assert ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(3)] == alone
    pen = dict(presence_penalty=0.5, frequency_penalty=0.7, logit_bias={"9": 3.0})
    want = reference.generate(["hello"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                        repetition_penalty=1.3, min_p=0.1, min_tokens=2,
                                                        presence_penalty=0.5, frequency_penalty=0.7,
                                                        logit_bias={9: 3.0}))[0]
    got = client.completions.create(model="infhip", prompt="hello", max_tokens=8, temperature=0, **pen,
                                    extra_body={"ignore_eos": True, "repetition_penalty": 1.3, "min_p": 0.1,
                                                "min_tokens": 2})
    assert got.choices[0].text == want.text


def test_served_names_and_neutral_fields(server, client):
    assert [m.id for m in client.models.list()] == ["infhip", "alias"]
    status, data = post(server, {"model": "other", "prompt": "x"})
    err = error_of(data)
    assert status == 404 and err["code"] == 404 and "infhip, alias" in err["message"]
    neutral = {"prompt": "x", "max_tokens": 2, "use_beam_search": False, "skip_special_tokens": True,
               "include_stop_str_in_output": False, "user": "u1", "metadata": {"a": "b"}, "n": 1, "best_of": 1,
               "suffix": None, "store": False}
    assert post(server, neutral)[0] == 200
    status, data = post(server, {**neutral, "include_stop_str_in_output": True})
    assert status == 400 and "include_stop_str_in_output=True is not supported" in error_of(data)["message"]
