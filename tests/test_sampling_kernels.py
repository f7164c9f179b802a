"""The sampler's kernels (plugins/sampling.py) against their plain-torch references, under the
Triton interpreter on CPU (compiled on a GPU), at small odd shapes: the fused stages (bitmask,
sparse entries, penalties from table slots) exactly (within a few ulps on a GPU), for every
combination of features and on a real SamplingBatch's packed arrays; the advance exactly;
logprobs' chosen logprob and top logprobs within float32 rounding, its rank and top
ids exactly (ties included); the device penalty slots (runtime/penalty_slots.py) equal to
counts rebuilt from the history across steps; and the AOT enumeration covers the launches."""

from __future__ import annotations

import collections
import itertools

import pytest
import torch

from infhip.plugins.sampling import (NEVER_DONE, advance_ref, advance_triton, logprobs_ref, logprobs_triton,
                                     stages_ref, stages_triton)
from infhip.runtime.penalty_slots import PenaltySlots
from infhip.runtime.sampler import Sampler, SamplingBatch
from infhip.runtime.sampling_params import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
V, B, S = 37, 5, 6  # odd vocabulary (2 bitmask words, the last partial), 5 rows, 6 table slots
NEG = float("-inf")


def assert_stages_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Exact under the interpreter; on a GPU the compiled kernel may fuse a penalty's multiply and
    subtract (one float32 rounding instead of two), so there within a few ulps, -inf alike."""
    if DEVICE == "cuda":
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(got, want)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, V, generator=g) * 3).to(DEVICE)
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (B, (V + 31) // 32), generator=g, dtype=torch.int64)
    mask = mask.to(torch.int32)
    mask[0] = -1  # row 0: everything allowed
    # row 1: a ban and a bias; row 2: none; row 3: min_tokens held (need 4 > 2) and a bias on
    # the same token; row 4: min_tokens no longer held (need 1 <= 3), a bias
    rows = [[(9, NEG, NEVER_DONE), (3, 5.5, NEVER_DONE)], [],
            [(6, NEG, 4), (6, 1.25, NEVER_DONE), (36, -7.0, NEVER_DONE)], [(2, NEG, 1), (0, 2.0, NEVER_DONE)]]
    rows = [[]] + rows
    ptr = [0] + list(itertools.accumulate(len(r) for r in rows))
    flat = [e for r in rows for e in r]
    i32 = dict(dtype=torch.int32, device=DEVICE)
    entries = (torch.tensor(ptr, **i32), torch.tensor([e[0] for e in flat], **i32),
               torch.tensor([e[2] for e in flat], **i32), torch.tensor([e[1] for e in flat], device=DEVICE),
               torch.tensor([0, 5, 1, 2, 3], **i32))
    counts = torch.randint(0, 3, (S, V), generator=g, dtype=torch.int32).to(DEVICE)
    seen = (torch.rand(S, V, generator=g) < 0.3).to(DEVICE)
    slot = torch.tensor([-1, 4, 0, -1, 2], **i32)  # rows 0 and 3 without penalties, slots out of order
    pen = torch.tensor([[1, 0, 0], [1.3, 0.4, -0.7], [0.7, 1.5, 0.0], [1, 0, 0], [1.1, 0.5, 0.5]], device=DEVICE)
    return x, mask.to(DEVICE), entries, (slot, pen, counts, seen)


@pytest.mark.parametrize("use", [c for c in itertools.product((0, 1), repeat=3) if any(c)])
def test_stages_exact_for_every_feature_combination(use):
    x, mask, entries, pens = _inputs()
    args = (mask if use[0] else None, entries if use[1] else None, pens if use[2] else None)
    got, want = stages_triton(x, *args), stages_ref(x, *args)
    assert_stages_equal(got, want)
    assert not torch.equal(want, x)  # every feature changes something here
    assert torch.equal(x, _inputs()[0])  # the logits (a graph's buffer) are never written


def test_stages_and_advance_on_a_real_batch():
    """The packed per-step copies of a SamplingBatch (views at odd offsets) through the kernels
    equal the reference, over two steps of one batch (out_len and counts advance)."""
    params = [SamplingParams(temperature=0),
              SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.7, temperature=0),
              SamplingParams(logit_bias={3: 5.5, 7: -100}, bad_words_token_ids=[[9]], temperature=0),
              SamplingParams(min_tokens=4, stop_token_ids=[6], frequency_penalty=1.5, temperature=0)]
    hist = [([1], [3]), ([5, 5, 8], [8, 8, 1, 30]), ([4], [1]), ([12], [2, 6])]
    batch = SamplingBatch(params, [None] * 4, DEVICE, V, hist, (2,))
    x, mask, _, _ = _inputs(1)
    x = x[:4].contiguous()
    batch.token_bitmask = mask[:4].contiguous()
    for step in range(2):
        want = stages_ref(x, batch.token_bitmask, batch.entries, batch.penalties)
        assert_stages_equal(stages_triton(x, batch.token_bitmask, batch.entries, batch.penalties), want)
        assert_stages_equal(Sampler().process(x, batch), want)
        tokens = want.argmax(-1)
        counts, out_len = batch.penalties[2].clone(), batch.out_len.clone()
        advance_ref(tokens, batch.out_len, batch.penalties)
        ref = (batch.penalties[2].clone(), batch.out_len.clone())
        batch.penalties[2].copy_(counts)
        batch.out_len.copy_(out_len)
        advance_triton(tokens, batch.out_len, batch.penalties)
        assert torch.equal(batch.penalties[2], ref[0]) and torch.equal(batch.out_len, ref[1])
        assert batch.out_len.tolist() == [len(h[1]) + step + 1 for h in hist]


@pytest.mark.parametrize("v,k", [(37, 0), (37, 3), (5001, 1), (5001, 20)])  # one tile; three, the last partial
def test_logprobs_kernel_matches_log_softmax(v, k):
    g = torch.Generator().manual_seed(v)
    x = (torch.randn(4, v, generator=g) * 4).to(DEVICE)
    x[2, : v // 2] = x[2, 0]  # many ties: rank counts strictly greater logits only
    x[3, 5] = x[3, 9] = x[3].max() + 1  # a tie at the top: the lower index first
    tokens = torch.tensor([0, v - 1, 0, 7], device=DEVICE)
    rows = torch.tensor([0, 2, 3], device=DEVICE)
    got, want = logprobs_triton(x, rows, tokens, k), logprobs_ref(x, rows, tokens, k)
    assert got.shape == (3, 2 + 2 * k)
    assert torch.equal(got[:, 1], want[:, 1])  # ranks
    torch.testing.assert_close(got[:, 0], want[:, 0], rtol=0, atol=2e-5)
    torch.testing.assert_close(got[:, 2:2 + k], want[:, 2:2 + k], rtol=0, atol=2e-5)
    top = x[rows].topk(k, dim=-1).values if k else x[rows][:, :0]
    assert torch.equal(x[rows].gather(1, got[:, 2 + k:].long()), top)  # the ids point at the top logits
    if k > 1:
        assert got[2, 2 + k:4 + k].tolist() == [5, 9]  # row 3's tie, in index order
    lp = torch.log_softmax(x[rows], -1)
    torch.testing.assert_close(got[:, 0], lp.gather(1, tokens[rows][:, None])[:, 0], rtol=0, atol=2e-5)


class _Seq:
    """A sequence as PenaltySlots sees it: a key with is_finished."""
    is_finished = False


def test_penalty_slots_follow_the_committed_output():
    """Slots advance on the device with the sampled tokens; a row whose host count disagrees
    (tokens sampled but not committed) is rebuilt; finished sequences' slots are reused and the
    tables grow when all are held."""
    slots = PenaltySlots(V, DEVICE)
    seqs = [_Seq() for _ in range(3)]
    prompts, outs = [[1, 2, 2], [3], [4, 5]], [[7, 7], [], [8]]

    def want(i):
        return torch.bincount(torch.tensor(outs[i], dtype=torch.int64), minlength=V).to(torch.int32)

    taken = slots.take([(s, p, o, True) for s, p, o in zip(seqs, prompts, outs)])
    assert len(set(taken)) == 3
    for i, s in enumerate(taken):
        assert torch.equal(slots.counts[s].cpu(), want(i))
        assert slots.seen[s].nonzero().flatten().tolist() == sorted(set(prompts[i]))
    # a step samples 11, 12, 13; seqs 0 and 1 commit theirs, seq 2's is dropped and it takes 9
    slots.counts[torch.tensor(taken, device=DEVICE), torch.tensor([11, 12, 13], device=DEVICE)] += 1
    slots.folded(seqs)
    outs[0].append(11)
    outs[1].append(12)
    outs[2].append(9)
    outs[2].append(10)
    again = slots.take([(s, p, o, True) for s, p, o in zip(seqs, prompts, outs)])
    assert again == taken
    for i, s in enumerate(taken):
        assert torch.equal(slots.counts[s].cpu(), want(i))
    seqs[1].is_finished = True
    more = [_Seq() for _ in range(8)]
    new = slots.take([(s, [], [i], False) for i, s in enumerate(more)])
    assert taken[1] in new and slots.counts.shape[0] == 16  # reused, then grown by doubling
    assert all(slots.counts[s].sum().item() == 1 and not slots.seen[s].any() for s in new)


def test_engine_enumerates_exactly_what_the_sampler_launches(tiny_engine):
    """AOT (plugins/aot.py): a tiny engine's run with every stage, logprobs and penalties, its
    launches recorded as on the GPU, launches only sampler variants that builder/kernels.py
    enumerates for it (7 stage combinations, 3 advance, logprobs' two kernels for each
    power-of-two top k 0..32); a plain greedy batch launches none of them."""
    from infhip import LLM
    from infhip.builder.kernels import enumerate_variants
    from infhip.config import EngineConfig
    from infhip.plugins.aot import Target, record

    engine = tiny_engine("llama", max_seq_len=64, max_batch_size=4)
    target = Target()
    enumerated = {v for v in enumerate_variants(EngineConfig.load(engine), target) if v.name in _SAMPLER_KERNELS}
    assert collections.Counter(v.name for v in enumerated) == {"_stages_kernel": 7, "_advance_kernel": 3,
                                                               "_logprobs_part_kernel": 7,
                                                               "_logprobs_merge_kernel": 7}
    llm = LLM(engine)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]

    def launched(params):
        with record(target, launch=True) as rec:
            llm.generate(prompt_token_ids=prompts, sampling_params=params)
        return {v for v in rec.variants if v.name in _SAMPLER_KERNELS}

    assert not launched(SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    got = launched([SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=2, repetition_penalty=1.2,
                                   presence_penalty=0.5),
                    SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logit_bias={3: 1.0}, min_tokens=2),
                    SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)])
    assert {v.name for v in got} == set(_SAMPLER_KERNELS)
    assert got <= enumerated, sorted(v.describe() for v in got - enumerated)


_SAMPLER_KERNELS = ("_stages_kernel", "_advance_kernel", "_logprobs_part_kernel", "_logprobs_merge_kernel")
