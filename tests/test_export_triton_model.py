"""The model.py infhip-export-triton writes, run in-process against a fake
`triton_python_backend_utils` (tests/_fake_triton.py) driving a real tiny engine: answers equal
LLM.generate (alone, streamed, three at once); unknown fields, wrong types and bad values get
INVALID_ARG responses; cancellation, unloading and a request the engine fails alone get error
responses; the custom metrics count what happened. The real tritonserver runs the same model in
tests/test_triton_server.py."""

from __future__ import annotations

import importlib.util
import sys
import time

import pytest

from infhip import SamplingParams
from infhip.runtime.serving.triton.export import export_triton_repo
from tests._fake_triton import (FINAL, FakeRequest, engine, fake_metric, fake_pb_utils,  # noqa: F401 (fixtures)
                                model_config_json, outputs, parse_pbtxt, reference, until, wait)

GREEDY = dict(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pb():
    mp = pytest.MonkeyPatch()
    module = fake_pb_utils()
    mp.setitem(sys.modules, "triton_python_backend_utils", module)
    yield module
    mp.undo()


def load_model(engine, repo, name, decoupled=True):
    """Export, then initialize the exported model.py as Triton would (config as JSON)."""
    out = export_triton_repo(engine, repo, model_name=name, decoupled=decoupled)
    spec = importlib.util.spec_from_file_location(f"triton_model_{name}", out / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    model.initialize({"model_config": model_config_json(parse_pbtxt((out / "config.pbtxt").read_text())),
                      "model_name": name, "model_version": "1"})
    return model


@pytest.fixture(scope="module")
def model(pb, engine, tmp_path_factory):
    m = load_model(engine, tmp_path_factory.mktemp("repo"), "tiny")
    yield m
    m.finalize()


def test_whole_answer_equals_generate(model, reference):
    want = reference.generate(["hello world"], SamplingParams(**GREEDY))[0]
    req = FakeRequest(text_input="hello world", **GREEDY)
    assert model.execute([req]) is None  # decoupled: answered through the sender
    [(resp, flags)] = wait(req)
    assert flags == FINAL
    assert outputs(resp) == {"text": want.text, "ids": want.token_ids, "reason": "length"}
    # a prompt given as token ids gives the same completion
    req = FakeRequest(input_ids=want.prompt_token_ids, **GREEDY)
    model.execute([req])
    assert outputs(wait(req)[0][0])["ids"] == want.token_ids


def test_stream_deltas_add_up(model, reference):
    want = reference.generate(["abc"], SamplingParams(**GREEDY))[0]
    req = FakeRequest(text_input="abc", stream=True, **GREEDY)
    model.execute([req])
    sent = wait(req)
    assert len(sent) > 1 and [f for _, f in sent] == [0] * (len(sent) - 1) + [FINAL]
    deltas = [outputs(r) for r, _ in sent]
    assert "".join(d["text"] for d in deltas) == want.text
    assert [t for d in deltas for t in d["ids"]] == want.token_ids
    assert [d["reason"] for d in deltas] == [""] * (len(deltas) - 1) + ["length"]


def test_concurrent_requests(model, reference):
    prompts = ["hello world", "The quick brown fox", "abc"]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (12, 7, 20)]
    want = reference.generate(prompts, params)
    reqs = [FakeRequest(text_input=p, max_tokens=sp.max_tokens, temperature=0.0, ignore_eos=True)
            for p, sp in zip(prompts, params)]
    model.execute(reqs[:2])
    model.execute(reqs[2:])  # a later execute joins the running batch
    for req, w in zip(reqs, want):
        [(resp, flags)] = wait(req)
        assert flags == FINAL and outputs(resp) == {"text": w.text, "ids": w.token_ids, "reason": "length"}


def test_sampling_inputs_reach_the_engine(model, reference):
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=20, seed=7, stop=["zz"],
                            stop_token_ids=[3])
    want = reference.generate(["hello"], params)[0]
    # Triton's reserved parameters (here one tritonclient sets) are not the model's business
    req = FakeRequest(text_input="hello", max_tokens=8, temperature=0.8, top_p=0.9, top_k=20, seed=7,
                      stop=["zz"], stop_token_ids=[3], triton_enable_empty_final_response=True)
    model.execute([req])
    got = outputs(wait(req)[0][0])
    assert got["ids"] == want.token_ids and got["reason"] == want.finish_reason


@pytest.mark.parametrize("inputs, message", [
    (dict(text_input="hi", max_token=4), "unknown input(s) max_token; accepted: ignore_eos, input_ids, "
                                         "max_tokens, seed, stop, stop_token_ids, stream, temperature, "
                                         "text_input, top_k, top_p"),
    (dict(text_input="hi", temprature=0, beam_width=2), "unknown input(s) beam_width, temprature;"),
    (dict(text_input="hi", max_tokens="4"), "max_tokens must be an int >= 1, got '4'"),
    (dict(text_input="hi", temperature="hot"), "temperature must be a finite number"),
    (dict(text_input="hi", ignore_eos=1), "ignore_eos must be a bool, got 1"),
    (dict(text_input="hi", stream="yes"), 'stream must be true or false, got "yes"'),
    (dict(text_input="hi", top_p=1.5), "top_p must be in (0, 1]"),
    (dict(max_tokens=4), "exactly one of text_input"),
    (dict(text_input="hi", input_ids=[5, 6]), "exactly one of text_input"),
    (dict(input_ids=[5, 999999]), "prompt token ids must be in [0, 300)"),
    (dict(text_input="hi", max_tokens=0), "max_tokens must be an int >= 1"),
])
def test_bad_request_gets_invalid_arg(model, pb, inputs, message):
    req = FakeRequest(**inputs)
    model.execute([req])
    [(resp, flags)] = wait(req)
    assert flags == FINAL and resp.has_error() and message in resp.error().message()
    assert resp.error().code() == pb.TritonError.INVALID_ARG  # HTTP 400, not 500
    assert not model.loop.core.num_requests  # it never stayed in the engine


def slow_steps(model, seconds):
    step = model.loop.core.step

    def slow():
        time.sleep(seconds)
        return step()
    model.loop.core.step = slow
    return step


def test_cancelled_request_is_aborted(model, pb):
    aborts = fake_metric(pb, "infhip_request_aborts_total")
    step = slow_steps(model, 0.02)  # 100 tokens take > 2 s; the cancel check runs every 0.1 s
    try:
        def cancel_after_first(sender):
            req.cancelled = True
        req = FakeRequest(on_send=cancel_after_first, text_input="hello", stream=True, max_tokens=100,
                          temperature=0.0, ignore_eos=True)
        model.execute([req])
        sent = wait(req)
        resp, flags = sent[-1]
        assert flags == FINAL and resp.has_error() and "cancelled" in resp.error().message()
        assert resp.error().code() == pb.TritonError.CANCELLED
        assert 1 <= sum(len(outputs(r)["ids"]) for r, _ in sent[:-1]) < 100
        deadline = time.monotonic() + 10
        while model.loop.core.num_requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not model.loop.core.num_requests  # aborted in the engine: its KV pages are free
        until(lambda: fake_metric(pb, "infhip_request_aborts_total") == aborts + 1)
    finally:
        model.loop.core.step = step


def test_request_failed_alone(model, pb, reference):
    """A request the engine fails alone (its last delta carries `error`) gets an INTERNAL error;
    the others go on."""
    errors = fake_metric(pb, "infhip_request_errors_total", scope="request")
    deltas = model.loop.core.deltas

    def failing_deltas(req):
        out = deltas(req)
        for d in out:
            if req.prompt == "fail me" and d.token_ids:
                d.finish_reason, d.error = "error", "out of pages"
        return out
    model.loop.core.deltas = failing_deltas
    try:
        want = reference.generate(["hello world"], SamplingParams(**GREEDY))[0]
        bad, good = FakeRequest(text_input="fail me", **GREEDY), FakeRequest(text_input="hello world", **GREEDY)
        model.execute([bad, good])
        [(resp, flags)] = wait(bad)
        assert flags == FINAL and resp.has_error() and resp.error().code() == pb.TritonError.INTERNAL
        assert "the engine failed this request: out of pages" in resp.error().message()
        assert outputs(wait(good)[0][0])["ids"] == want.token_ids
    finally:
        model.loop.core.deltas = deltas
    until(lambda: not model.loop.core.num_requests)  # the failed one is forgotten too
    until(lambda: fake_metric(pb, "infhip_request_errors_total", scope="request") == errors + 1)


def test_metrics_count_what_happened(model, pb, reference):
    prompts, max_tokens = ["hello world", "The quick brown fox"], [6, 9]
    want = reference.generate(prompts, [SamplingParams(**{**GREEDY, "max_tokens": n}) for n in max_tokens])
    names = ["infhip_prompt_tokens_total", "infhip_generation_tokens_total", "infhip_time_to_first_token_seconds",
             "infhip_inter_token_latency_seconds", "infhip_e2e_request_latency_seconds",
             "infhip_request_decode_time_seconds", "infhip_time_per_output_token_seconds"]
    before = {n: fake_metric(pb, n) for n in names}
    length = fake_metric(pb, "infhip_requests_finished_total", finish_reason="length")
    reqs = [FakeRequest(text_input=p, stream=i == 0, **{**GREEDY, "max_tokens": n})
            for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    model.execute(reqs)
    for req in reqs:
        wait(req)
    expected = {"infhip_prompt_tokens_total": sum(len(w.prompt_token_ids) for w in want),
                "infhip_generation_tokens_total": sum(max_tokens),
                "infhip_time_to_first_token_seconds": 2,  # one observation per request
                "infhip_inter_token_latency_seconds": sum(max_tokens) - 2,  # one per later token
                "infhip_e2e_request_latency_seconds": 2, "infhip_request_decode_time_seconds": 2,
                "infhip_time_per_output_token_seconds": 2}  # one per request
    until(lambda: {n: fake_metric(pb, n) - before[n] for n in names} == expected)
    assert fake_metric(pb, "infhip_requests_finished_total", finish_reason="length") == length + 2
    assert fake_metric(pb, "infhip_request_success_total", finish_reason="length") == length + 2
    until(lambda: fake_metric(pb, "infhip_requests_running") == fake_metric(pb, "infhip_kv_pages_used") == 0)
    stats = model.loop.core.stats()  # every page free again: used + free of the core's own count
    assert fake_metric(pb, "infhip_kv_pages_free", group="global", memory="gpu") == (
        stats.kv_pages_used["global"] + stats.kv_pages_free["global"])
    assert fake_metric(pb, "infhip_kv_cache_usage_ratio", group="global") == 0
    [family] = [pb.MetricFamily.families["infhip_requests_waiting"]]
    assert {"model": "tiny", "version": "1"} in [m.labels for m in family.metrics]


def test_not_decoupled_and_finalize(pb, engine, reference, tmp_path):
    m = load_model(engine, tmp_path / "repo", "whole", decoupled=False)
    try:
        want = reference.generate(["hello world", "abc"], SamplingParams(**GREEDY))
        reqs = [FakeRequest(text_input=p, **GREEDY) for p in ("hello world", "abc")]
        reqs.append(FakeRequest(text_input="abc", stream=True, **GREEDY))
        responses = m.execute(reqs)
        assert [outputs(r)["ids"] for r in responses[:2]] == [w.token_ids for w in want]
        assert responses[2].has_error() and "decoupled" in responses[2].error().message()
    finally:
        m.finalize()

    m = load_model(engine, tmp_path / "repo2", "unload")
    slow_steps(m, 0.05)
    req = FakeRequest(text_input="hello", max_tokens=100, temperature=0.0, ignore_eos=True)
    m.execute([req])
    time.sleep(0.2)
    m.finalize()  # a request still running learns that the model went away
    [(resp, flags)] = wait(req, timeout=10)
    assert flags == FINAL and resp.has_error() and "unloaded" in resp.error().message()
