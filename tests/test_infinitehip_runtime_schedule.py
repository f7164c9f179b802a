"""Mask-caching schedule (host only): which stages a request's decode step recomputes, per
preset, on one refresh clock for all requests; slot reuse; the planner's per-step decisions and
the CUDA-graph keys they give."""

from __future__ import annotations

import pytest
import torch

from infhip.methods.infinitehip import infinitehip_config
from infhip.methods.infinitehip.runtime.mask_cache import MaskSlots, refresh_from, refresh_schedule
from infhip.runtime.sampling_params import SamplingParams
from infhip.runtime.sequence import Sequence, SequenceStatus
from infhip.methods.infinitehip.runtime import planner as sparse_plan
from infhip.methods.infinitehip.runtime.planner import SparseGraphKey, SparsePlanner


def stage_steps(intervals, num_steps, clock=0):
    """For each stage: the steps (< num_steps) at which it is recomputed."""
    sched = refresh_schedule(num_steps, intervals, clock)
    return [[j for j, stages in enumerate(sched) if i in stages] for i in range(len(intervals))]


@pytest.mark.parametrize("preset, intervals", [("3k", (16, 8, 4)), ("3k-fast", (32, 16, 8)),
                                               ("3k-flash", (96, 24, 8)), ("5k", (16, 8, 4))])
def test_schedule_per_preset(preset, intervals):
    assert infinitehip_config(preset).refresh_intervals == intervals
    n = 200
    for i, steps in enumerate(stage_steps(intervals, n)):
        # step 0 computes everything; then every n_refresh(i) steps
        assert steps == [0] + [j for j in range(1, n) if j % intervals[i] == 0]
    for j, stages in enumerate(refresh_schedule(n, intervals)):
        assert stages == tuple(range(stages[0], 3)) if stages else True  # a stage implies the later ones


def test_schedule_3k_first_steps():
    assert refresh_schedule(9, (16, 8, 4)) == [(0, 1, 2), (), (), (), (2,), (), (), (), (1, 2)]
    assert [refresh_from(j, j, (96, 24, 8)) for j in (0, 8, 24, 48, 96)] == [0, 2, 1, 1, 0]


def test_late_request_joins_the_common_clock():
    """A request whose first sparse step runs at clock 3 recomputes everything then, and
    afterwards at the clock's multiples, not at multiples of its own step count."""
    intervals = (16, 8, 4)
    assert stage_steps(intervals, 40, clock=3)[0] == [0, 13, 29]  # clock 16 and 32
    assert stage_steps(intervals, 12, clock=3)[2] == [0, 1, 5, 9]  # clock 4, 8, 12


def seq(i, n=10):
    s = Sequence(seq_id=i, prompt_token_ids=[1] * n, params=SamplingParams())
    s.status = SequenceStatus.RUNNING
    return s


def test_slots_reuse_and_invalidate():
    slots = MaskSlots(2)
    a, b, c = seq(0), seq(1), seq(2)
    assert [slots.next_decode(a) for _ in range(5)] == [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4)]
    assert slots.next_decode(b) == (1, 0) and slots.scratch == 2
    slots.invalidate(a.seq_id)  # e.g. preempted and re-prefilled: next step recomputes all
    assert slots.next_decode(a) == (0, 0)
    with pytest.raises(RuntimeError):
        slots.next_decode(c)
    b.status = SequenceStatus.FINISHED
    assert slots.next_decode(c) == (1, 0)  # b's slot reclaimed


def test_slots_go_lowest_first():
    """The lowest free slot is handed out, and a finished request's slot is reclaimed before a
    higher free one is used: the requests decoding at once hold the lowest slots (the key
    bank's rows, MaskCache.bank_slots)."""
    slots = MaskSlots(4)
    a, b, c, d = seq(0), seq(1), seq(2), seq(3)
    assert [slots.next_decode(s)[0] for s in (a, b, c)] == [0, 1, 2]
    slots.release(b.seq_id)
    a.status = SequenceStatus.FINISHED  # not released yet: reclaimed when a new request comes
    assert slots.next_decode(d)[0] == 0 and slots.next_decode(b)[0] == 1
    assert slots.next_decode(c) == (2, 1)  # a running request keeps its slot


def test_planner_decisions():
    cfg = infinitehip_config("3k", dict(n_sink=4, n_stream=8, stages=[(8, 4, 32), (8, 2, 16), (8, 1, 8)],
                                        special_final_k=16, dense_threshold=50, stagger_refresh=False))
    planner = SparsePlanner(cfg, max_slots=4, trained_window=100)
    a, b, c, d = seq(0, 60), seq(1, 20), seq(2, 70), seq(3, 30)
    # batch: decodes a (sparse), b (dense); prefill chunks c (ends at 70: sparse), d (dense)
    h = planner.plan([a, b, c, d], [60, 20, 70, 30], num_decodes=2)
    assert h.decode_rows == [0] and h.dense_decode_lens == [0, 20] and h.prefill_seqs == [2]
    assert h.dense_prefill_runs == [(3, 4)] and h.refresh == ((True, True, True),) and not h.dynamic_rope
    h = planner.plan([a, b], [61, 21], num_decodes=2)
    assert h.decode_first_stage == [(3,)] and h.refresh == ((False, False, False),)
    h = planner.plan([a], [120], num_decodes=1)  # past the trained window: dynamic RoPE
    assert h.dynamic_rope
    step = planner.to_device(planner.plan([c, d], [70, 30], 0), [0, 10, 20], [70, 30], lambda v, t: torch.tensor(v, dtype=t))
    assert step.prefill_q_start.tolist() == [0, 8] and step.prefill_q_lens.tolist() == [8, 2]
    assert step.prefill_ends.tolist() == [68, 70] and step.prefill_seqs.tolist() == [0, 0]


def test_raw_keys_decision(monkeypatch):
    """Raw keys only with dynamic RoPE, enough query blocks, and sparse prefill contexts that sum
    to at most raw_keys_max_tokens (the scratch the runner reserved)."""
    monkeypatch.setattr(sparse_plan, "RAW_KEYS_MIN_BLOCKS", 8)  # tiny blocks: the threshold at 8
    cfg = infinitehip_config("3k", dict(n_sink=4, n_stream=8, stages=[(8, 4, 32), (8, 2, 16), (8, 1, 8)],
                                        special_final_k=16, dense_threshold=50))
    tensor = lambda v, t: torch.tensor(v, dtype=t)  # noqa: E731
    big = seq(0, 200)  # a 72-token chunk ending at 200: 9 query blocks of 8

    def raw(planner, end, chunk=72):
        return planner.to_device(planner.plan([big], [end], 0), [0, chunk], [end], tensor).raw_keys

    planner = SparsePlanner(cfg, max_slots=2, trained_window=100, raw_keys_max_tokens=1000)
    assert raw(planner, 200)  # past the window (dynamic RoPE), 9 >= 8 blocks, 200 <= 1000 tokens
    assert not raw(planner, 200, chunk=40)  # 5 blocks
    assert not raw(SparsePlanner(cfg, max_slots=2, trained_window=100, raw_keys_max_tokens=150), 200)
    assert not raw(SparsePlanner(cfg, max_slots=2, trained_window=1000, raw_keys_max_tokens=1000), 200)


def test_layer_stagger_spreads_one_requests_refreshes():
    """Staggered: 4 InfiniteHiP layers over a 16-step cycle fall in 4 phase groups; after the
    first (full) step each step refreshes stage 1 in at most one group, every group once per
    cycle; the device view holds per-group row lists. Unstaggered: one group, all at once."""
    cfg = infinitehip_config("3k", dict(n_sink=4, n_stream=8, stages=[(8, 4, 32), (8, 2, 16), (8, 1, 8)],
                                        special_final_k=16, dense_threshold=50))
    planner = SparsePlanner(cfg, max_slots=2, trained_window=100, num_sparse_layers=4)
    assert planner.group_offsets == [0, 4, 8, 12] and planner.layer_group == [0, 1, 2, 3]
    a = seq(0, 60)
    firsts = [planner.plan([a], [60 + j], num_decodes=1).decode_first_stage[0] for j in range(17)]
    assert firsts[0] == (0, 0, 0, 0)
    stage1 = [[g for g, f in enumerate(fs) if f == 0] for fs in firsts[1:]]
    assert all(len(x) <= 1 for x in stage1) and sorted(g for x in stage1 for g in x) == [0, 1, 2, 3]
    h = planner.plan([a], [80], num_decodes=1)
    step = planner.to_device(h, [0, 1], [80], lambda v, t: torch.tensor(v, dtype=t))
    assert len(step.stage_rows) == 4 and all(len(rows) == 3 for rows in step.stage_rows)
    for g in range(4):
        for i in range(3):
            assert step.stage_rows[g][i].tolist() == ([0] if h.decode_first_stage[0][g] <= i else [])
            assert h.refresh[g][i] == (h.decode_first_stage[0][g] <= i)
    flat = SparsePlanner(cfg.replace(stagger_refresh=False), max_slots=2, trained_window=100, num_sparse_layers=4)
    assert flat.group_offsets == [0] and flat.layer_group == [0, 0, 0, 0]


def test_graph_keys_of_decode_batches():
    """A step of sparse decode rows that refresh alike has a graph key (refresh pattern,
    candidate capacity, dynamic RoPE); a newcomer's full first step, a dense decode row or a
    prefill chunk in the step leaves it to the eager path. The key repeats with the cycle."""
    cfg = infinitehip_config("3k", dict(n_sink=4, n_stream=8, stages=[(8, 4, 32), (8, 2, 16), (8, 1, 8)],
                                        special_final_k=16, dense_threshold=50))
    planner = SparsePlanner(cfg, max_slots=4, trained_window=100, num_sparse_layers=4)
    a, b, c = seq(0, 60), seq(1, 60), seq(2, 20)
    full = tuple((True, True, True) for _ in range(4))
    assert planner.plan([a], [60], 1).graph_key == SparseGraphKey(full, 1024, False, True)  # a alone: its full first step
    h = planner.plan([a, b], [61, 60], 2)  # b's first step recomputes all, a's does not
    assert h.decode_first_stage[1] == (0, 0, 0, 0) and h.decode_first_stage[0] != h.decode_first_stage[1]
    assert h.graph_key is None
    keys = [planner.plan([a, b], [62 + j, 61 + j], 2).graph_key for j in range(2 * 16)]
    assert all(k is not None for k in keys) and keys[:16] == keys[16:]  # one cycle of the clock
    key = keys[0]
    assert key.capacity == 1024 and not key.dynamic_rope and key.bank_ok and len(key.refresh) == 4
    assert planner.plan([a, c], [100, 21], 2).graph_key is None  # c stays dense
    assert planner.plan([a, c], [101, 21], 1).graph_key is None  # c is a prefill chunk
    h = planner.plan([a], [1200], 1)  # past the trained window, capacity doubles past 1024
    assert h.graph_key == SparseGraphKey(h.refresh, 2048, True, True)
    few = SparsePlanner(cfg.replace(key_bank_slots=1), max_slots=4, trained_window=100, num_sparse_layers=4)
    assert few.plan([a], [60], 1).bank_ok  # a holds slot 0, which owns the bank row
    h = few.plan([a, b], [61, 60], 2)
    assert h.decode_slots == [0, 1] and not h.bank_ok  # b's slot 1 has none: the step rotates keys


@pytest.mark.parametrize("preset, patterns", [("3k", 6), ("3k-flash", 14)])
def test_graph_keys_listed_at_load_cover_every_decode_step(preset, patterns):
    """Every graph key decode steps produce — one request, two joining later, contexts crossing
    the trained window and several capacity doublings — is one of planner.graph_keys(), which
    the runner captures at load: n_refresh(0) / n_refresh(-1) + 2 refresh patterns per dynamic
    RoPE mode (phases aligned to the last interval), one fixed candidate capacity."""
    cfg = infinitehip_config(preset, dict(n_sink=4, n_stream=8, stages=[(8, 4, 32), (8, 2, 16), (8, 1, 8)],
                                          special_final_k=16, dense_threshold=50))
    planner = SparsePlanner(cfg, max_slots=4, trained_window=100, num_sparse_layers=32, max_seq_len=5000)
    listed = planner.graph_keys()
    assert len(listed) == 2 * patterns and len({k.capacity for k in listed}) == 1
    a, b, c = seq(0, 60), seq(1, 60), seq(2, 60)
    seen = set()
    for j in range(400):
        batch = [(a, 60 + 10 * j)] + ([(b, 80 + 10 * j)] if j >= 37 else []) + ([(c, 90 + 10 * j)] if j >= 91 else [])
        h = planner.plan([s for s, _ in batch], [n for _, n in batch], len(batch))
        if h.graph_key is not None:
            seen.add(h.graph_key)
    assert seen and seen <= set(listed), list(set(seen) - set(listed))[:2]
    assert {k.dynamic_rope for k in seen} == {False, True}  # inside and past the trained window
