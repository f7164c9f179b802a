"""Issue 33's sampling features (CPU): the sampler's stages exact against a plain-torch reference
(penalties, logit_bias, bad words, min_tokens, min_p, the token bitmask); logprobs and prompt
logprobs equal transformers' log_softmax within 1e-4 (float32, tiny Llama); n forks share the
prompt's pages and equal n separately seeded requests; best_of keeps the highest cumulative
logprobs; priority admits a short request while a long prompt is mid-prefill."""

from __future__ import annotations

import pytest
import torch

from infhip import LLM, SamplingParams
from infhip.runtime.sequence import SequenceStatus
from infhip.runtime.sampler import Sampler, SamplingBatch, apply_token_bitmask
from tests._tiny import API_ENGINE

V = 37  # odd vocabulary
EOS = (2,)


def _reference_process(logits, params, histories):
    """Stages 1-5 of runtime/sampler.py, row by row in plain torch (bitmask aside)."""
    out = logits.float().clone()
    for i, (p, (prompt, output)) in enumerate(zip(params, histories)):
        x = out[i]
        for q in p.bad_words_token_ids or ():
            if len(q) == 1 or output[len(output) - len(q) + 1:] == q[:-1]:
                x[q[-1]] = float("-inf")
        if len(output) < p.min_tokens:
            for t in list(p.stop_token_ids) + ([] if p.ignore_eos else list(EOS)):
                x[t] = float("-inf")
        for t, b in (p.logit_bias or {}).items():
            x[t] += b
        if p.repetition_penalty != 1:
            for t in set(prompt) | set(output):
                x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=V).float()
        x -= p.frequency_penalty * counts  # vLLM's order: frequency, then presence
        x -= p.presence_penalty * (counts > 0).float()
    return out


PARAMS = [
    SamplingParams(temperature=0),  # plain: untouched
    SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.7, temperature=0.8),
    SamplingParams(logit_bias={3: 5.5, 7: -100}, bad_words_token_ids=[[9], [4, 5, 11]], temperature=0),
    SamplingParams(min_tokens=4, stop_token_ids=[6], frequency_penalty=1.5, seed=3),
    SamplingParams(repetition_penalty=0.7, logit_bias={0: 2}, min_p=0.2, seed=4),
]
HISTORIES = [([1, 2], [3]), ([5, 5, 8], [8, 8, 1, 30]), ([4], [1, 4, 5]), ([12], [2, 6]), ([3, 3, 36], [36, 20])]


def _logits(b, seed=0):
    return torch.randn(b, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_stages_exact_vs_reference_and_device_state_advances():
    logits = _logits(len(PARAMS))
    batch = SamplingBatch(PARAMS, [None] * len(PARAMS), "cpu", V, HISTORIES, EOS)
    assert torch.equal(Sampler().process(logits, batch), _reference_process(logits, PARAMS, HISTORIES))
    assert batch.host_each_step  # the multi-token bad word is matched on the host
    # Two steps on one batch (a run of decode steps): the second sees the first's tokens.
    out = Sampler().sample(logits, batch).tokens.tolist()
    grown = [(pr, o + [t]) for (pr, o), t in zip(HISTORIES, out)]
    logits2 = _logits(len(PARAMS), seed=1)
    got = Sampler().process(logits2, batch)
    want = _reference_process(logits2, PARAMS, grown)
    rows = [0, 1, 3, 4]  # row 2's multi-token bad word is the host's (rebuilt each step)
    assert torch.equal(got[rows], want[rows])


def test_plain_batch_processes_nothing_and_greedy_sees_the_stages():
    plain = SamplingBatch([SamplingParams(temperature=0)] * 3, [None] * 3, "cpu", V)
    assert not plain.processes and plain.penalties is None and plain.logprob_rows == []
    logits = _logits(1)
    biased = SamplingParams(temperature=0, logit_bias={5: 100.0})
    assert Sampler()([logits[0:1]][0], [biased], [None]).item() == 5


def test_min_p_keeps_exactly_the_tokens_above_the_threshold():
    logits = _logits(1, seed=2)
    probs = torch.softmax(logits[0] / 0.9, -1)
    keep = set((probs >= 0.3 * probs.max()).nonzero().flatten().tolist())
    p = SamplingParams(temperature=0.9, min_p=0.3)
    seen = {Sampler()(logits, [p], [torch.Generator().manual_seed(s)]).item() for s in range(200)}
    assert seen <= keep and len(seen) == len(keep)


def test_token_bitmask_masks_exactly_the_clear_bits():
    x = _logits(2)
    mask = torch.full((2, (V + 31) // 32), -1, dtype=torch.int32)
    mask[1, 0] = (1 << 3) | (1 << 17)  # row 1: only tokens 3 and 17 of the first word
    mask[1, 1] = 0
    y = apply_token_bitmask(x.clone(), mask)
    assert torch.equal(y[0], x[0])
    assert torch.isfinite(y[1]).nonzero().flatten().tolist() == [3, 17]
    batch = SamplingBatch([SamplingParams(temperature=0)] * 2, [None] * 2, "cpu", V)
    batch.token_bitmask = mask
    assert Sampler().sample(x, batch).tokens[1].item() in (3, 17)


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), "SamplingParams.n must be an int in [1, 128]"),
    (dict(n=3, best_of=2), "SamplingParams.best_of must be None or an int in [n, 128]"),
    (dict(logprobs=21), "SamplingParams.logprobs must be None or an int in [0, 20]"),
    (dict(presence_penalty=2.5), "SamplingParams.presence_penalty must be a number in [-2, 2]"),
    (dict(repetition_penalty=0), "SamplingParams.repetition_penalty must be a finite number > 0"),
    (dict(min_p=1.5), "SamplingParams.min_p must be in [0, 1]"),
    (dict(min_tokens=20, max_tokens=10), "SamplingParams.min_tokens must be an int in [0, max_tokens = 10]"),
    (dict(logit_bias={1: 101}), "SamplingParams.logit_bias must be a dict"),
    (dict(bad_words=[" "]), "SamplingParams.bad_words must be a list of non-blank strings"),
    (dict(priority=1.5), "SamplingParams.priority must be an int"),
])
def test_feature_validation(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(message), str(e.value)


# -- on the tiny engine ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine(**API_ENGINE)


@pytest.fixture(scope="module")
def llm(engine):
    return LLM(engine)


@pytest.fixture(scope="module")
def hf(tiny_checkpoint):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint(tokenizer=True), torch_dtype=torch.float32).eval()


PROMPT = list(range(3, 44))  # 41 tokens: two full pages of 16 and a partial one


def test_logprobs_and_prompt_logprobs_equal_transformers(llm, hf):
    sp = SamplingParams(max_tokens=6, temperature=0.9, seed=1, ignore_eos=True, logprobs=4, prompt_logprobs=3)
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=sp)[0]
    ids = PROMPT + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for pos in range(1, len(ids)):
        rec = out.prompt_logprobs[pos] if pos < len(PROMPT) else out.logprobs[pos - len(PROMPT)]
        row, k = ref[pos - 1], (3 if pos < len(PROMPT) else 4)
        assert rec.token_id == ids[pos]
        assert abs(rec.logprob - row[ids[pos]].item()) < 1e-4
        assert rec.rank == int((row > row[ids[pos]]).sum()) + 1
        top_lp, top_ids = row.topk(k)
        assert [t for t, _ in rec.top] == top_ids.tolist()
        assert max(abs(a - b) for (_, a), b in zip(rec.top, top_lp.tolist())) < 1e-4
    assert out.outputs[0].cumulative_logprob == pytest.approx(sum(r.logprob for r in out.logprobs))
    # streamed: the same records, the prompt's on the first delta
    deltas = list(llm.generate_stream(prompt_token_ids=PROMPT, sampling_params=sp))
    assert deltas[0].prompt_logprobs == out.prompt_logprobs
    assert [r for d in deltas for r in d.logprobs] == out.logprobs


def test_n_forks_share_the_prompt_pages_and_equal_seeded_requests(llm):
    n, seed = 3, 11
    base = dict(max_tokens=8, temperature=1.0, ignore_eos=True)
    llm.reset_prefix_cache()
    hits = llm.stats().prefix_cache_hits
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(n=n, seed=seed, **base))[0]
    assert llm.stats().prefix_cache_hits - hits == (n - 1) * 32  # each fork reused the two full pages
    alone = [llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(seed=seed + i, **base))[0]
             for i in range(n)]
    assert [o.index for o in out.outputs] == list(range(n))
    assert [o.token_ids for o in out.outputs] == [a.token_ids for a in alone]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    streamed = list(llm.generate_stream(prompt_token_ids=PROMPT,
                                        sampling_params=SamplingParams(n=n, seed=seed, **base)))
    for i in range(n):
        assert [t for d in streamed if d.index == i for t in d.token_ids] == alone[i].token_ids
        assert [d.finish_reason for d in streamed if d.index == i][-1] == "length"


def test_best_of_keeps_the_highest_cumulative_logprobs(llm):
    base = dict(max_tokens=5, temperature=1.0, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(n=2, best_of=4, seed=5, **base))[0]
    alone = [llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(seed=5 + i, logprobs=0, **base))[0]
             for i in range(4)]
    ranked = sorted(alone, key=lambda o: -o.outputs[0].cumulative_logprob)[:2]
    assert [o.token_ids for o in out.outputs] == [a.token_ids for a in ranked]
    assert out.outputs[0].logprobs is None  # not asked: only ranked by


def test_penalties_and_bias_on_the_engine(llm):
    greedy = dict(max_tokens=12, temperature=0, ignore_eos=True)
    plain = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(**greedy))[0]
    forced = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(logit_bias={7: 100}, **greedy))[0]
    assert forced.token_ids == [7] * 12
    banned = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(
        bad_words_token_ids=[[plain.token_ids[0]]], **greedy))[0]
    assert plain.token_ids[0] not in banned.token_ids
    rep = llm.generate(prompt_token_ids=[PROMPT],
                       sampling_params=SamplingParams(presence_penalty=2, frequency_penalty=2, **greedy))[0]
    assert len(set(rep.token_ids)) >= len(set(plain.token_ids))
    eos = llm.core.eos_token_ids[0]
    early = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(
        max_tokens=12, temperature=0, logit_bias={eos: 100}, min_tokens=3))[0]
    # EOS held back while fewer than 3 tokens are out (vLLM's rule): it comes 4th
    assert len(early.token_ids) == 4 and early.token_ids[3] == eos and eos not in early.token_ids[:3]
    assert early.finish_reason == "stop"


def test_priority_admits_a_short_request_during_a_long_prefill(engine):
    llm = LLM(engine, max_num_batched_tokens=8, max_num_seqs=4)
    long = llm.core.add_request(None, list(range(3, 103)), SamplingParams(max_tokens=2, temperature=0))  # 13 chunks of 8
    for _ in range(3):
        llm.core.step()
    assert 0 < long.seq.num_computed_tokens < 90
    short = llm.core.add_request(None, [5, 6, 7], SamplingParams(max_tokens=4, temperature=0, priority=-1))
    short_first = long_done = None
    for step in range(40):
        llm.core.step()
        if short_first is None and short.seq.output_token_ids:
            short_first = step
        if long_done is None and long.seq.output_token_ids:
            long_done = step
        if short.is_finished and long.is_finished:
            break
    assert short_first is not None and long_done is not None and short_first < long_done
    assert short.is_finished and short.seq.num_output_tokens == 4
    # without the priority the short one waits for the long prefill (FIFO: the old behaviour)
    long = llm.core.add_request(None, list(range(150, 250)), SamplingParams(max_tokens=2, temperature=0))  # not cached
    for _ in range(3):
        llm.core.step()
    late = llm.core.add_request(None, [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    while not late.seq.output_token_ids:
        llm.core.step()
    assert long.seq.output_token_ids


def test_kv_pressure_preempts_the_worst_priority_first(engine, llm):
    """Three greedy requests growing to 108 tokens (7 pages of 16 each) in a 12-page cache: the
    priority-2 request, second by arrival, loses its KV first (the arrival-only rule took the
    newest, request 2); every answer still equals the request run alone."""
    page_bytes = 3 * 2 * 2 * 16 * 16 * 4  # layers x (K, V) x kv heads x head_dim x page size x float32
    small = LLM(engine, kv_cache_memory_bytes=13 * page_bytes, max_num_seqs=4)
    assert small.runner.kv.groups["global"].num_pages == 13
    params = [SamplingParams(max_tokens=100, temperature=0, ignore_eos=True, priority=p) for p in (0, 2, 0)]
    reqs = [small.core.add_request(None, [10 + i] * 8, p) for i, p in enumerate(params)]
    evicted = []
    for _ in range(1000):
        running = [r for r in reqs if r.seq.status is SequenceStatus.RUNNING]
        small.core.step()
        evicted += [reqs.index(r) for r in running if r.seq.status is SequenceStatus.WAITING]
        if all(r.is_finished for r in reqs):
            break
    assert evicted and evicted[0] == 1, evicted
    for i, r in enumerate(reqs):
        alone = llm.generate(prompt_token_ids=[[10 + i] * 8], sampling_params=params[i])[0]
        assert r.seq.output_token_ids == alone.token_ids


def test_back_to_back_decode_steps_equal_single_steps(engine, llm):
    """num_decode_steps 4 (the GPU default's path, run eagerly here): penalties and min_tokens
    advance on the device between steps, logprobs are read once after the run; all equal to one
    step at a time."""
    multi = LLM(engine, num_decode_steps=4)
    sps = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2, repetition_penalty=1.4,
                          frequency_penalty=0.6, presence_penalty=0.3),
           SamplingParams(max_tokens=10, temperature=0.8, seed=9, min_tokens=6, logit_bias={llm.core.eos_token_ids[0]: 50},
                          logprobs=0),
           SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)]
    prompts = [PROMPT, PROMPT[:20], PROMPT[5:30]]
    one = llm.generate(prompt_token_ids=prompts, sampling_params=sps)
    runs, run = [], multi.runner.execute_decode_steps
    multi.runner.execute_decode_steps = lambda out, k, sample: runs.append(k) or run(out, k, sample)
    four = multi.generate(prompt_token_ids=prompts, sampling_params=sps)
    assert runs and set(runs) == {4}  # the back-to-back path ran
    for a, b in zip(one, four):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        if a.logprobs is not None:
            assert [r.token_id for r in a.logprobs] == [r.token_id for r in b.logprobs]
            assert [r.logprob for r in a.logprobs] == pytest.approx([r.logprob for r in b.logprobs], abs=1e-5)
    assert len(one[1].token_ids) == 7 and one[1].finish_reason == "stop"  # EOS held back until 6 were out
