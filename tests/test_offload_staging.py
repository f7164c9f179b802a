"""Staged prefill over an offloaded cache (runtime/offload/staging.py): the plan (which host
pages go to which staging slot, in how many copies), the buffers, and the in-place fallback.
That staged prefill reads only the staged copies and generates the resident run's tokens is
tests/test_kv_offload_runtime.py's main test (the host pools are NaN while prefill kernels run:
tests/_offload.py poison_host_during_staged_prefill)."""

from __future__ import annotations

import pytest
import torch

from infhip.runtime.offload.staging import plan_staging

from .test_infinitehip_runtime import PROMPTS
from .test_kv_offload_runtime import GREEDY, MiB, PAST, engines, run, small_batches  # noqa: F401 (fixtures)


def test_plan_renumbers_host_entries_of_the_staged_rows_only():
    tables = [[1, -3, -2, 4, -10], [-6, 5], [-4, 7]]
    plan = plan_staging(tables, rows=[0, 2], capacity=16)
    # host pages 1, 2, 3, 9 (entries -2, -3, -4, -10) -> slots 0..3; row 1 (not staged) keeps -6
    assert plan.tables == [[1, -2, -1, 4, -4], [-6, 5], [-3, 7]]
    assert plan.runs == [(1, 0, 3), (9, 3, 1)] and plan.num_pages == 4
    # every staged entry maps back to the host page its slot holds
    slot_host = {s + i: h + i for h, s, n in plan.runs for i in range(n)}
    for b in (0, 2):
        for old, new in zip(tables[b], plan.tables[b]):
            assert (old >= 0 and new == old) or slot_host[-1 - new] == -1 - old


def test_plan_declines_what_it_cannot_stage():
    assert plan_staging([[1, 2, 3]], rows=[0], capacity=8) is None  # no host page
    assert plan_staging([[-1, -2, -3]], rows=[0], capacity=2) is None  # over capacity
    scattered = [[-1 - 2 * i for i in range(10)]]  # host pages 0, 2, 4, ...: ten runs
    assert plan_staging(scattered, rows=[0], capacity=64, max_runs=9) is None
    assert len(plan_staging(scattered, rows=[0], capacity=64, max_runs=10).runs) == 10


def test_prefill_reads_in_place_when_staging_is_off(engines, small_batches, monkeypatch):
    """enabled = False (or a step that does not fit the buffers): the kernels read the host pool."""
    from infhip import LLM

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    expected, _ = run(engines["3k"], 0)
    llm = LLM(engines["3k"], max_num_batched_tokens=48, infinitehip_overrides=PAST, kv_offload_bytes=4 * MiB)
    llm.runner.staging.enabled = False
    got = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
    assert llm.runner.staging.pages_staged == 0
    assert got == expected


def test_staging_buffers_hold_one_sequence(engines):
    from infhip import LLM

    runner = LLM(engines["3k"], kv_offload_bytes=4 * MiB).runner
    staging, host = runner.staging, runner.offload_layers[0].kv.host
    assert staging.capacity == min(host.num_pages, runner.max_pages_per_seq)
    assert len(staging.buffers) == 2 and staging.buffers[0].k.shape[1:] == host.k.shape[1:]
    assert staging.buffers[0].k.dtype == host.k.dtype and staging.buffers[0].k_scale is None
    assert LLM(engines["3k"]).runner.staging is None
    fp8 = LLM(engines["3k-fp8"], kv_offload_bytes=4 * MiB).runner.staging
    assert fp8.buffers[1].v_scale is not None and fp8.buffers[1].v_scale.dtype == torch.float32
