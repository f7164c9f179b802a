"""Staged prefill over an offloaded cache (runtime/offload_staging.py): the plan (which host
pages go to which staging slot, in how many copies), and in the runtime that prefill kernels read
only the staged copies — the host pools are NaN while they run — and generate the resident run's
tokens, staged or not."""

from __future__ import annotations

import pytest
import torch

from infhip.runtime.offload_staging import StagedStep, plan_staging

from .test_infinitehip_runtime import PROMPTS
from .test_kv_offload_runtime import GREEDY, MiB, SHORT, engines, run, small_batches  # noqa: F401 (fixtures)


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


@pytest.fixture
def poisoned_host_during_prefill(monkeypatch):
    """While a layer's staged prefill runs, its host pool is NaN (restored after): a kernel that
    read a host page instead of the staged copy would poison the output."""
    saved = {}

    def poison(host):
        for t in (host.k, host.v, host.k_scale, host.v_scale):
            if t is not None:
                saved[id(t)] = t.clone()
                t.fill_(float("nan"))

    def restore(host):
        for t in (host.k, host.v, host.k_scale, host.v_scale):
            if t is not None:
                t.copy_(saved.pop(id(t)))

    real_acquire, real_release = StagedStep.acquire, StagedStep.release
    calls = []

    def acquire(self, layer):
        twin = real_acquire(self, layer)  # (on CPU the copies are done when it returns)
        poison(self.staging.hosts[self.staging.order[layer]])
        calls.append(layer)
        return twin

    def release(self, layer):
        restore(self.staging.hosts[self.staging.order[layer]])
        real_release(self, layer)

    monkeypatch.setattr(StagedStep, "acquire", acquire)
    monkeypatch.setattr(StagedStep, "release", release)
    return calls


@pytest.mark.parametrize("engine", ["3k", "3k-fp8"])
def test_staged_prefill_reads_only_the_staged_copies(engines, small_batches, poisoned_host_during_prefill,
                                                     monkeypatch, engine):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # torch references: fast
    expected, _ = run(engines[engine], 0)
    got, moved = run(engines[engine], 4 * MiB)
    assert moved >= 10 and len(poisoned_host_during_prefill) >= 4, "no staged prefill step ran"
    assert got == expected


def test_staged_kernels_generate_the_resident_tokens(engines, small_batches, poisoned_host_during_prefill):
    """The Triton kernels (interpreter) over a staged twin: a CPU tensor at another address than
    the host pool, reached by the same element offsets."""
    prompts = [PROMPTS[0], PROMPTS[2]]
    expected, _ = run(engines["3k"], 0, prompts=prompts, params=SHORT)
    got, _ = run(engines["3k"], 4 * MiB, prompts=prompts, params=SHORT)
    assert len(poisoned_host_during_prefill) >= 2
    assert got == expected


def test_prefill_reads_in_place_when_staging_is_off(engines, small_batches, monkeypatch):
    """enabled = False (or a step that does not fit the buffers): the kernels read the host pool."""
    from infhip import LLM

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    expected, _ = run(engines["3k"], 0)
    from .test_kv_offload_runtime import PAST

    llm = LLM(engines["3k"], max_num_batched_tokens=48, infinitehip_overrides=PAST, kv_offload_bytes=4 * MiB)
    llm.runner.staging.enabled = False
    got = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
    assert llm.runner.staging.pages_staged == 0
    assert got == expected


def test_staging_buffers_hold_one_sequence(engines):
    from infhip import LLM

    runner = LLM(engines["3k"], kv_offload_bytes=4 * MiB).runner
    staging, host = runner.staging, runner.offload_layers[0].host_kv
    assert staging.capacity == min(host.num_pages, runner.max_pages_per_seq)
    assert len(staging.buffers) == 2 and staging.buffers[0].k.shape[1:] == host.k.shape[1:]
    assert staging.buffers[0].k.dtype == host.k.dtype and staging.buffers[0].k_scale is None
    assert LLM(engines["3k"]).runner.staging is None
    fp8 = LLM(engines["3k-fp8"], kv_offload_bytes=4 * MiB).runner.staging
    assert fp8.buffers[1].v_scale is not None and fp8.buffers[1].v_scale.dtype == torch.float32
