"""One request's fault is that request's alone (runtime/engine_core.py's rule), on the tiny API engine
(vocab 300, max_seq_len 128, 4 sequences): bad requests raise ValueError before anything is
queued; a fault injected into one request in flight (StepHooks.before_forward, sampling, detokenizing)
finishes it with finish_reason "error" while the others produce exactly the tokens they produce
alone; a failing batched forward fails that step's requests and the engine goes on. Afterwards
no request is left and every KV page is free."""

from __future__ import annotations

import dataclasses
import json

import pytest

from infhip import LLM, SamplingParams
from infhip.runtime.sequence import Sequence
from tests._tiny import API_ENGINE

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [20, 21]]


class Injected(RuntimeError):
    pass


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine(**API_ENGINE)


@pytest.fixture(scope="module")
def alone(engine):
    """Each prompt's greedy tokens when it runs by itself."""
    llm = LLM(engine)
    return [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0].token_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def llm(engine):
    return LLM(engine)


def free_pages(llm):
    return llm.stats().kv_pages_free


def assert_idle(llm, free):
    """No request left anywhere and every KV page free again."""
    view = llm.debug_view()
    assert (view["requests"], view["running"], view["waiting"]) == ({}, [], [])
    assert free_pages(llm) == free


def run(llm, reqs):
    """Step until every request finished; the requests each step returned, per step."""
    returned = []
    while not all(r.seq.is_finished for r in reqs):
        returned.append(llm.core.step())
    return returned


def seed_mutated():
    p = SamplingParams(seed=1)
    p.seed = 10**40  # after construction: add_request checks every field again
    return p


def case(name, call, needle):
    return pytest.param(call, needle, id=name)


@pytest.mark.parametrize("call, needle", [
    case("seed-10**40", lambda llm: llm.generate(["hi"], SamplingParams(seed=10**40)), "seed"),
    case("seed-set-later", lambda llm: llm.generate(["hi"], seed_mutated()), "seed"),
    case("top_k-10**12", lambda llm: llm.generate(["hi"], SamplingParams(top_k=10**12)),
         "top_k must be at most the vocabulary size 300"),
    case("top_k-vocab+1", lambda llm: llm.generate(["hi"], SamplingParams(top_k=301)), "top_k"),
    case("stop_token_ids-10**12", lambda llm: llm.generate(["hi"], SamplingParams(stop_token_ids=[2, 10**12])),
         r"stop_token_ids .* \[0, 300\)"),
    case("stop_token_ids-vocab", lambda llm: llm.generate(["hi"], SamplingParams(stop_token_ids=[300])),
         "stop_token_ids"),
    case("params-dict", lambda llm: llm.generate(["hi"], {"max_tokens": 3}), "must be a SamplingParams"),
    case("prompt-bytes", lambda llm: llm.generate([b"hi"], GREEDY), "a prompt must be a string"),
    case("ids-float", lambda llm: llm.generate(prompt_token_ids=[[5, 1.5]], sampling_params=GREEDY), "list of ints"),
    case("ids-bool", lambda llm: llm.generate(prompt_token_ids=[[5, True]], sampling_params=GREEDY), "list of ints"),
    case("ids-negative", lambda llm: llm.generate(prompt_token_ids=[5, -1], sampling_params=GREEDY),
         r"in \[0, 300\)"),
    case("ids-empty", lambda llm: llm.generate(prompt_token_ids=[[]], sampling_params=GREEDY), "empty prompt"),
    case("stream-seed-set-later", lambda llm: list(llm.generate_stream("hi", seed_mutated())), "seed"),
    case("stream-ids-10**12", lambda llm: list(llm.generate_stream(prompt_token_ids=[5, 10**12],
                                                                   sampling_params=GREEDY)), r"\[0, 300\)"),
])
def test_bad_requests_raise_before_anything_is_queued(llm, alone, call, needle):
    free = free_pages(llm)
    with pytest.raises(ValueError, match=needle):
        call(llm)
    assert_idle(llm, free)
    assert llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY)[0].token_ids == alone[0]


def test_params_at_the_edges_are_served(llm):
    """64-bit seeds at both ends, top_k = vocabulary, and max_tokens far past max_seq_len (lowered
    to what is left of it: a 120-token prompt of a 128-token engine gets 8)."""
    for seed in (-2**63, 2**64 - 1):
        out = llm.generate(["hi"], SamplingParams(max_tokens=3, seed=seed, top_k=300, ignore_eos=True))[0]
        assert len(out.token_ids) == 3 and out.error is None
    huge = SamplingParams(max_tokens=10**40, temperature=0.0, ignore_eos=True)
    req = llm.core.add_request(None, [7] * 120, huge)
    assert req.seq.params.max_tokens == 8 and huge.max_tokens == 10**40  # a copy; the caller's is untouched
    run(llm, [req])
    assert len(req.seq.output_token_ids) == 8 and req.seq.finish_reason == "length"
    llm.core.abort(req)


@pytest.mark.parametrize("num_decode_steps", [1, 4])
def test_before_forward_hook_fails_one_request_while_the_others_go_on(engine, alone, num_decode_steps):
    """Request 1 fails in the first step that finds it with 3 or more tokens (mid-decode, the
    others in flight): its 4th with single steps (3 tokens), its 3rd with fused decode steps of 4
    (1 + 4 tokens). The others' tokens are those they produce alone."""
    llm = LLM(engine, num_decode_steps=num_decode_steps)
    free = free_pages(llm)
    calls = []

    def hook(seq: Sequence) -> None:
        calls.append(seq.seq_id)
        if seq.prompt_token_ids == PROMPTS[1] and seq.num_output_tokens >= 3:
            raise Injected("fault injected into request 1")

    llm.core.hooks.before_forward = hook
    reqs = [llm.core.add_request(None, p, GREEDY) for p in PROMPTS]
    returned = run(llm, reqs)
    bad = reqs[1]
    assert bad.seq.finish_reason == "error" and bad.error.endswith("Injected: fault injected into request 1")
    steps, tokens = (4, 3) if num_decode_steps == 1 else (3, 5)
    assert calls.count(bad.seq.seq_id) == steps  # once per step it was scheduled in
    assert bad.seq.output_token_ids == alone[1][:tokens]
    assert any(bad in step for step in returned)  # step() hands the failed request back
    for r, want in zip(reqs, alone):
        if r is not bad:
            assert r.seq.output_token_ids == want and r.seq.finish_reason == "length" and r.error is None
    final = llm.core.delta(bad)
    assert final.finish_reason == "error" and final.error == bad.error
    for r in reqs:
        llm.core.abort(r)
    assert_idle(llm, free)


def test_faults_in_sampling_and_detokenizing_fail_only_their_request(engine, alone):
    """The batched sampler raises whenever request 0 is in the batch (it is then sampled row by
    row, and only request 0's row raises); request 2's detokenizer raises at its 5th token."""
    llm = LLM(engine)
    free = free_pages(llm)
    sample = llm.core.sampler.sample
    marked = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, top_k=7)  # top_k: a mark only

    def sampler(logits, batch):
        if any(p.top_k == 7 for p in batch.params):
            raise Injected("sampler fault")
        return sample(logits, batch)

    llm.core.sampler.sample = sampler
    reqs = [llm.core.add_request(None, PROMPTS[0], marked), llm.core.add_request(None, PROMPTS[1], GREEDY), llm.core.add_request(None, PROMPTS[2], GREEDY)]
    detok = reqs[2].forks[0].detok
    update = detok.update

    def detok_update(token_ids):
        if len(token_ids) == 5:
            raise Injected("detokenizer fault")
        return update(token_ids)

    detok.update = detok_update
    run(llm, reqs)
    assert reqs[0].seq.finish_reason == "error" and "while sampling its token" in reqs[0].error
    assert reqs[0].seq.output_token_ids == []
    assert reqs[2].seq.finish_reason == "error" and "detokenizer fault" in reqs[2].error
    assert reqs[2].seq.output_token_ids == alone[2][:5]
    assert reqs[1].seq.output_token_ids == alone[1] and reqs[1].error is None
    outputs = [llm.core.output(r) for r in reqs]
    assert [o.finish_reason for o in outputs] == ["error", "length", "error"]
    assert outputs[2].error == reqs[2].error and outputs[1].error is None
    assert_idle(llm, free)


def test_failed_batched_forward_fails_that_step_and_the_engine_goes_on(engine, alone):
    """Two sequences at a time: the forward of the 3rd step raises, failing the two requests in
    it; the third request, still waiting, then runs as it does alone, and so does a later one."""
    llm = LLM(engine, max_num_seqs=2)
    free = free_pages(llm)
    execute, calls = llm.runner.execute, []

    def failing_execute(out):
        calls.append(len(out.chunks))
        if len(calls) == 3:
            raise Injected("device fault")
        return execute(out)

    llm.runner.execute = failing_execute
    reqs = [llm.core.add_request(None, p, GREEDY) for p in PROMPTS]
    run(llm, reqs)
    assert calls[2] == 2
    for r in reqs[:2]:
        assert r.seq.finish_reason == "error" and "in the batched forward of its step" in r.error
        assert len(r.seq.output_token_ids) == 2
    assert reqs[2].seq.output_token_ids == alone[2] and reqs[2].error is None
    for r in reqs:
        llm.core.abort(r)
    assert_idle(llm, free)
    assert llm.generate(prompt_token_ids=[PROMPTS[1]], sampling_params=GREEDY)[0].token_ids == alone[1]


def test_stream_ends_with_an_error_delta(engine, alone):
    llm = LLM(engine)
    free = free_pages(llm)

    def hook(seq):
        if seq.num_output_tokens == 4:
            raise Injected("stream fault")

    llm.core.hooks.before_forward = hook
    deltas = list(llm.generate_stream(prompt_token_ids=PROMPTS[0], sampling_params=GREEDY))
    assert [t for d in deltas for t in d.token_ids] == alone[0][:4]
    assert deltas[-1].finish_reason == "error" and "stream fault" in deltas[-1].error
    assert all(d.finish_reason is None and d.error is None for d in deltas[:-1])
    assert_idle(llm, free)
    llm.core.hooks.before_forward = None
    assert llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY)[0].token_ids == alone[0]


def test_a_sequence_queued_behind_llms_back_does_not_break_it(llm, alone):
    """A sequence put on the scheduler directly (not through add_request) has no request to answer: it
    is finished with "error" instead of failing every later step (the KeyError of issue 19)."""
    free = free_pages(llm)
    orphan = Sequence(seq_id=10**6, prompt_token_ids=[5, 6], params=GREEDY)
    llm.scheduler.add(orphan)
    assert llm.generate(prompt_token_ids=[PROMPTS[2]], sampling_params=GREEDY)[0].token_ids == alone[2]
    assert orphan.finish_reason == "error"
    assert_idle(llm, free)


def test_stats_count_requests_and_pages(engine):
    llm = LLM(engine, max_num_seqs=1)
    idle = llm.stats()
    total = {g: idle.kv_pages_used[g] + idle.kv_pages_free[g] for g in idle.kv_pages_free}
    assert (idle.num_running, idle.num_waiting) == (0, 0) and set(idle.kv_pages_used.values()) == {0}
    assert idle.host_pages_used == idle.host_pages_free == {}  # no host pool without kv_offload_bytes
    reqs = [llm.core.add_request(None, [5] * 40, GREEDY), llm.core.add_request(None, PROMPTS[0], GREEDY)]
    assert (llm.stats().num_running, llm.stats().num_waiting) == (0, 2)
    llm.core.step()
    busy = llm.stats()
    assert (busy.num_running, busy.num_waiting) == (1, 1)
    assert all(busy.kv_pages_used[g] == 3 and busy.kv_pages_used[g] + busy.kv_pages_free[g] == total[g]
               for g in total)  # 41 tokens in pages of 16
    run(llm, reqs)
    after = llm.stats()  # idle again; the prefix cache keeps the full pages (counted as free)
    assert after.prefix_cache_queries == 40 + len(PROMPTS[0]) and sum(after.kv_pages_cached.values()) > 0
    assert dataclasses.replace(after, kv_pages_cached=idle.kv_pages_cached, prefix_cache_queries=0) == idle


def test_debug_view_shows_requests_queues_and_pages(engine):
    llm = LLM(engine, max_num_seqs=1)
    first, second = llm.core.add_request(None, [5] * 40, GREEDY), llm.core.add_request(None, PROMPTS[0], GREEDY)
    llm.core.step()
    view = json.loads(json.dumps(llm.debug_view()))  # JSON-able (request ids become strings)
    assert (view["running"], view["waiting"]) == ([first.request_id], [second.request_id])
    [running] = view["requests"][str(first.request_id)]["completions"]
    [waiting] = view["requests"][str(second.request_id)]["completions"]
    assert (running["status"], running["prompt_tokens"], running["computed_tokens"], running["output_tokens"]) == \
        ("running", 40, 40, 1)
    assert running["kv_pages"] == view["stats"]["kv_pages_used"]  # the only request holding pages
    assert waiting["status"] == "waiting" and set(waiting["kv_pages"].values()) == {0}
    run(llm, [first, second])
    for req in (first, second):
        llm.core.output(req)
    view = llm.debug_view()
    assert (view["requests"], view["running"], view["waiting"]) == ({}, [], [])
