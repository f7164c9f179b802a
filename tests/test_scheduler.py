"""Scheduler: continuous batching with chunked prefill, driven by a fake model.

The fake model keeps a real "KV cache" (one token id per slot, per group): it writes each
chunk's tokens through ``slot_mapping`` and, for chunks with ``needs_logits``, reads the whole
context back through ``block_table`` (the window only, for a windowed group), checking every
read. Its next token is a hash of that context, so wrong page bookkeeping changes the output,
and a batch must produce exactly the tokens each request produces alone.
"""

import random

import pytest

from infhip.runtime.kv_cache import KVCacheManager, KVGroupSpec
from infhip.runtime.scheduler import Scheduler, ScheduledChunk
from infhip.runtime.sampling_params import SamplingParams
from infhip.runtime.sequence import Sequence, SequenceStatus

V = 97
EOS = (0, 1, 2, 3, 4)  # several, so that some requests stop early


class FakeModel:
    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self.cache = {g: [-1] * (s.num_pages * kv.page_size) for g, s in kv.groups.items()}

    def __call__(self, out) -> dict[int, int]:
        ps, sampled = self.kv.page_size, {}
        for c in out.chunks:
            if c.seq.is_finished:  # aborted between schedule() and the forward pass
                continue
            toks = c.seq.all_token_ids
            for g in self.kv.groups:
                for slot, t in zip(self.kv.slot_mapping(c.seq.seq_id, g, c.start, c.end),
                                   toks[c.start:c.end]):
                    assert slot >= ps, "wrote to the null page"
                    self.cache[g][slot] = t
            if not c.needs_logits:
                continue
            h = toks[c.end - 1] + 1
            for g, spec in self.kv.groups.items():
                bt = self.kv.block_table(c.seq.seq_id, g)
                lo = 0 if spec.window is None else max(0, c.end - spec.window)
                for p in range(lo, c.end):
                    got = self.cache[g][bt[p // ps] * ps + p % ps]
                    assert got == toks[p], f"seq {c.seq.seq_id} group {g} position {p}"
                    h = (h * 31 + got) % 1_000_003
            sampled[c.seq.seq_id] = h % V
        return sampled


def make(page_size=4, num_pages=256, window=None, max_num_seqs=8, budget=32, max_seq_len=128):
    groups = {"global": KVGroupSpec(num_pages, None)}
    if window:
        groups["sliding"] = KVGroupSpec(num_pages, window)
    kv = KVCacheManager(page_size, groups, max_pages_per_seq=-(-max_seq_len // page_size))
    return Scheduler(kv, max_num_seqs, budget, max_seq_len), FakeModel(kv)


def step(sched, model, eos=EOS):
    out = sched.schedule()
    return out, sched.update(out, model(out), eos)


def run_all(sched, model, seqs, arrivals=None, max_steps=5000):
    """Add seqs (at step arrivals[i], default all at 0) and step until all finish."""
    arrivals = arrivals or [0] * len(seqs)
    outs = []
    for n in range(max_steps):
        for s, a in zip(seqs, arrivals):
            if a == n:
                sched.add(s)
        if not sched.has_unfinished() and n > max(arrivals, default=-1):
            return outs
        outs.append(step(sched, model)[0])
        assert outs[-1].num_tokens <= sched.max_num_batched_tokens
        assert sched.num_running <= sched.max_num_seqs
    raise AssertionError("did not finish")


def new_seq(i, prompt_len, max_tokens=8, ignore_eos=True, **kw):
    rng = random.Random(i)
    prompt = [rng.randrange(1, V) for _ in range(prompt_len)]
    return Sequence(i, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, **kw))


def alone(seq, **cfg):
    s = Sequence(seq.seq_id, list(seq.prompt_token_ids), seq.params)
    sched, model = make(**cfg)
    run_all(sched, model, [s])
    return s.output_token_ids, s.finish_reason


def test_chunk_fields():
    seq = new_seq(0, 10)
    assert ScheduledChunk(seq, 4, 6).end == 10 and not ScheduledChunk(seq, 0, 4).needs_logits
    with pytest.raises(ValueError, match="outside sequence"):
        ScheduledChunk(seq, 8, 4)


def test_add_validation():
    sched, _ = make(max_seq_len=16)
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add(Sequence(0, [], SamplingParams()))
    with pytest.raises(ValueError, match=r"17 tokens exceeds max_seq_len 16.*--max-seq-len"):
        sched.add(new_seq(1, 17))
    sched.add(new_seq(2, 16))
    with pytest.raises(ValueError, match="already in use"):
        sched.add(new_seq(2, 3))
    small, _ = make(num_pages=3, page_size=4)
    with pytest.raises(ValueError, match="needs 3 KV pages"):
        small.add(new_seq(3, 9))


def test_chunked_prefill_of_long_prompt():
    sched, model = make(budget=16)
    seq = new_seq(0, 100, max_tokens=3)
    sched.add(seq)
    starts = []
    for _ in range(7):
        out, _ = step(sched, model)
        (c,) = out.chunks
        starts.append(c.start)
        assert c.needs_logits == (c.end == 100) and not c.is_decode
    assert starts == [0, 16, 32, 48, 64, 80, 96] and seq.num_output_tokens == 1
    run_all(sched, model, [])
    assert (seq.output_token_ids, seq.finish_reason) == alone(seq, budget=100)


def test_budget_decodes_first_and_joining_leaving():
    sched, model = make(budget=20, max_num_seqs=4)
    seqs = [new_seq(i, n, max_tokens=m) for i, (n, m) in
            enumerate([(30, 5), (3, 12), (50, 2), (7, 7), (12, 9), (1, 4), (25, 3)])]
    arrivals = [0, 0, 1, 2, 2, 6, 9]
    outs = run_all(sched, model, seqs, arrivals)
    for out in outs:
        kinds = [c.is_decode for c in out.chunks]
        assert kinds == sorted(kinds, reverse=True) and out.num_decodes == sum(kinds)
        assert len({c.seq.seq_id for c in out.chunks}) == len(out.chunks)
    # Sequences joined while others ran, and finished ones left mid-run.
    running_sets = [{c.seq.seq_id for c in o.chunks} for o in outs]
    assert any(len(r) >= 3 for r in running_sets)
    assert any(any(c.is_decode for c in o.chunks) and any(not c.is_decode for c in o.chunks)
               for o in outs), "no step mixed decodes and prefills"
    for s in seqs:
        assert s.is_finished and s.finish_reason == "length"
        assert (s.output_token_ids, s.finish_reason) == alone(s)
    assert sched.kv.num_free_pages("global") == 255


@pytest.mark.parametrize("window", [None, 6])
def test_mixed_batch_equals_alone_with_eos(window):
    rng = random.Random(window or 0)
    seqs = [new_seq(i, rng.randint(1, 60), max_tokens=rng.randint(1, 20), ignore_eos=i % 3 == 0)
            for i in range(12)]
    sched, model = make(window=window, budget=24, max_num_seqs=5)
    run_all(sched, model, seqs, [rng.randint(0, 15) for _ in seqs])
    for s in seqs:
        assert (s.output_token_ids, s.finish_reason) == alone(s, window=window)
        if s.finish_reason == "stop":
            assert s.output_token_ids[-1] in EOS and not s.params.ignore_eos
    assert {s.finish_reason for s in seqs} == {"stop", "length"}
    assert all(sched.kv.num_free_pages(g) == 255 for g in sched.kv.groups)


@pytest.mark.parametrize("window", [None, 5])
def test_preemption_then_all_complete(window):
    # 12 usable pages of 4 tokens; 4 sequences that each grow to 40 tokens cannot all fit.
    seqs = [new_seq(i, 20 + i, max_tokens=18) for i in range(4)]
    sched, model = make(num_pages=13, window=window, budget=64, max_num_seqs=4, max_seq_len=64)
    outs = run_all(sched, model, seqs)
    preempted = [s.seq_id for o in outs for s in o.preempted]
    assert preempted, "expected preemption"
    # The newest running sequence is the victim: never sequence 0, the oldest.
    assert 0 not in preempted
    for s in seqs:
        assert (s.output_token_ids, s.finish_reason) == alone(s, window=window)
    assert sched.kv.num_free_pages("global") == 12


def test_on_free_reports_each_freed_sequence():
    """on_free hears of every sequence whose pages were freed, after its status changed: each
    preemption (WAITING, recomputed later) and each finish (FINISHED), once."""
    seqs = [new_seq(i, 20 + i, max_tokens=18) for i in range(4)]
    sched, model = make(num_pages=13, budget=64, max_num_seqs=4, max_seq_len=64)
    freed = []
    sched.on_free = lambda seq: freed.append((seq.seq_id, seq.status))
    outs = run_all(sched, model, seqs)
    preempted = [s.seq_id for o in outs for s in o.preempted]
    assert preempted
    assert sorted(i for i, st in freed if st is SequenceStatus.WAITING) == sorted(preempted)
    assert sorted(i for i, st in freed if st is SequenceStatus.FINISHED) == [0, 1, 2, 3]


def test_prefill_chunk_shrinks_to_free_pages():
    # 11 usable pages: `late`'s prefill competes with `first`'s decodes for the last pages.
    first, late = new_seq(0, 4, max_tokens=24), new_seq(1, 36, max_tokens=2)
    sched, model = make(num_pages=12, budget=16, max_num_seqs=4, max_seq_len=64)
    outs = run_all(sched, model, [first, late])
    # Some prefill chunk was cut by pages, not by the budget or the prompt's end.
    assert any(not c.needs_logits and c.start > 0 and o.num_tokens < 16
               for o in outs for c in o.chunks)
    for o in outs:  # nobody is admitted in a step that preempted (it would only thrash)
        if o.preempted:
            assert all(c.start > 0 for c in o.chunks)
    for s in (first, late):
        assert (s.output_token_ids, s.finish_reason) == alone(s)


def test_older_prefill_preempts_newer_scheduled_decode():
    # White-box: normal flow keeps the only partial prefill the newest running sequence, so
    # grow the oldest one's prompt (as a multi-turn append would) to reach this path.
    old, new = new_seq(0, 8, max_tokens=2), new_seq(1, 7, max_tokens=2)
    sched, model = make(num_pages=5, budget=32, max_seq_len=32)  # 4 usable pages: both hold 2
    for s in (old, new):
        sched.add(s)
    step(sched, model)
    assert sched.kv.num_free_pages("global") == 0
    old.prompt_token_ids += [5, 6, 7]  # positions 8..10: a new page
    out = sched.schedule()
    # `new`'s decode (its page was already there) was scheduled first, then retracted.
    assert out.preempted == [new] and [(c.seq, c.start, c.num_tokens) for c in out.chunks] == [(old, 8, 4)]
    assert out.num_tokens == 4 and new.status is SequenceStatus.WAITING
    sched.update(out, model(out), EOS)
    run_all(sched, model, [])
    assert old.is_finished and new.is_finished and new.num_output_tokens == 2


def test_preempted_goes_to_front_of_waiting():
    # 10 usable pages of 4 tokens; three sequences growing to 38 tokens each.
    seqs = [new_seq(i, 8, max_tokens=30) for i in range(3)]
    sched, model = make(num_pages=11, budget=64, max_num_seqs=4, max_seq_len=64)
    for s in seqs:
        sched.add(s)
    step(sched, model)
    late = new_seq(9, 30, max_tokens=2)  # waits: does not fit next to the three
    sched.add(late)
    while not (out := step(sched, model)[0]).preempted:
        pass
    assert out.preempted[0].seq_id == 2  # the newest running one goes first
    assert list(sched.waiting) == out.preempted[::-1] + [late]  # in front of `late`, oldest first
    assert out.preempted[0].status is SequenceStatus.WAITING and out.preempted[0].num_computed_tokens == 0
    assert all(c.seq not in out.preempted for c in out.chunks)
    run_all(sched, model, [])
    for s in seqs + [late]:
        assert (s.output_token_ids, s.finish_reason) == alone(s)


def test_max_seq_len_cut():
    sched, model = make(max_seq_len=16)
    a, b = new_seq(0, 10, max_tokens=100), new_seq(1, 16, max_tokens=100)
    run_all(sched, model, [a, b])
    assert (a.num_output_tokens, a.num_tokens, a.finish_reason) == (6, 16, "length")
    assert (b.num_output_tokens, b.finish_reason) == (1, "length")


def test_fifo_admission_no_skipping():
    # 10 usable pages of 4 tokens; the head request needs 8 pages at once (budget 64).
    sched, model = make(num_pages=11, budget=64, max_num_seqs=8, max_seq_len=64)
    first = new_seq(0, 16, max_tokens=12)  # 4 pages at start, grows to 7
    big = new_seq(1, 30, max_tokens=2)  # 8 pages: does not fit next to `first`
    small = new_seq(2, 3, max_tokens=2)  # 1 page: would fit, but must not skip `big`
    for s in (first, big, small):
        sched.add(s)
    out, _ = step(sched, model)
    assert [c.seq.seq_id for c in out.chunks] == [0]
    assert list(sched.waiting) == [big, small]
    order = []
    while sched.has_unfinished():
        out, fin = step(sched, model)
        order += [s.seq_id for s in fin]
        if big.status is SequenceStatus.WAITING:
            assert small.status is SequenceStatus.WAITING
    assert order == [0, 1, 2]


def test_max_num_seqs_and_finish_abort():
    sched, model = make(max_num_seqs=2)
    seqs = [new_seq(i, 5, max_tokens=50) for i in range(4)]
    for s in seqs:
        sched.add(s)
    out, _ = step(sched, model)
    assert {c.seq.seq_id for c in out.chunks} == {0, 1} and sched.num_waiting == 2
    out = sched.schedule()
    sched.finish(seqs[0], "abort")  # between schedule() and update(): its chunk is skipped
    sched.update(out, model(out), EOS)
    assert seqs[0].finish_reason == "abort" and seqs[0].num_output_tokens == 1
    sched.finish(seqs[3], "stop"), sched.finish(seqs[3], "abort")  # a waiting one; idempotent
    assert seqs[3].finish_reason == "stop" and sched.num_waiting == 1
    out, _ = step(sched, model)
    assert {c.seq.seq_id for c in out.chunks} == {1, 2}
    with pytest.raises(ValueError, match="finish reason"):
        sched.finish(seqs[1], "done")


def test_stop_token_ids():
    sched, model = make()
    ref = new_seq(0, 6, max_tokens=10)
    out_tokens, _ = alone(ref)
    s = new_seq(1, 6, max_tokens=10, stop_token_ids=[out_tokens[3]])
    s.prompt_token_ids = list(ref.prompt_token_ids)
    run_all(sched, model, [s])
    stop_at = out_tokens.index(out_tokens[3]) + 1
    assert s.output_token_ids == out_tokens[:stop_at] and s.finish_reason == "stop"


def test_sequence_too_long_for_cache_alone_raises():
    # 4 usable pages (16 tokens) but max_seq_len 64: the sequence outgrows the cache.
    sched, model = make(num_pages=5, max_seq_len=64)
    sched.add(new_seq(0, 10, max_tokens=40))
    with pytest.raises(RuntimeError, match="even with every other sequence preempted"):
        for _ in range(40):
            step(sched, model)


def test_preemption_evicts_the_worst_priority_first():
    # 12 usable pages of 4 tokens; three sequences of 8 prompt tokens growing to 32 need 24.
    # seq 1 has the worst priority but is not the newest: the arrival-only rule would evict seq 2.
    prio = {0: 0, 1: 2, 2: 0}
    seqs = [new_seq(i, 8, max_tokens=24, priority=prio[i]) for i in range(3)]
    sched, model = make(num_pages=13, budget=64, max_num_seqs=4, max_seq_len=64)
    outs = run_all(sched, model, seqs)
    preempted = [s.seq_id for o in outs for s in o.preempted]
    assert preempted and preempted[0] == 1, preempted
    # while seq 1 runs, no priority-0 sequence loses its KV (it would be the victim first)
    for o in outs:
        running_low = any(c.seq.seq_id == 1 for c in o.chunks) or 1 in [s.seq_id for s in o.preempted]
        if running_low:
            assert [s.seq_id for s in o.preempted] in ([], [1]), o.preempted
    for s in seqs:
        assert (s.output_token_ids, s.finish_reason) == alone(s)
    assert sched.kv.num_free_pages("global") == 12


def test_a_decode_of_the_worst_priority_preempts_itself():
    # the lone priority-5 sequence is the oldest: when the cache runs out on its decode, it goes
    # back to the queue rather than take the pages of the urgent ones
    seqs = [new_seq(0, 8, max_tokens=24, priority=5)] + [new_seq(i, 8, max_tokens=24) for i in (1, 2)]
    sched, model = make(num_pages=13, budget=64, max_num_seqs=4, max_seq_len=64)
    sched.add(seqs[0])
    step(sched, model)  # seq 0 runs first, alone
    for s in seqs[1:]:
        sched.add(s)
    while not (out := step(sched, model)[0]).preempted:
        pass
    assert [s.seq_id for s in out.preempted] == [0]
    assert seqs[1].status is SequenceStatus.RUNNING and seqs[2].status is SequenceStatus.RUNNING
    run_all(sched, model, [])
    for s in seqs:
        assert (s.output_token_ids, s.finish_reason) == alone(s)
