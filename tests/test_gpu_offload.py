"""KV offloading on the GPU: pinned host pages read in place by the compiled kernels, inside the
sparse CUDA graphs (whose page tables are re-staged when pages move). Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

import infhip.runtime.offload.policy as offload_policy
from infhip.plugins.kv_offload import HostKV

pytestmark = pytest.mark.gpu


def test_host_pool_is_pinned_at_its_exact_size():
    """cudaHostRegister, not the caching host allocator (which rounds up to a power of two)."""
    cache = torch.empty((7, 16, 8, 128), dtype=torch.bfloat16, device="cuda")
    host = HostKV.like(cache, 1000)
    assert host.k.is_pinned() and host.v.is_pinned()
    assert host.k.untyped_storage().nbytes() == 1000 * 16 * 8 * 128 * 2


@pytest.mark.parametrize("kv_dtype,staged", [("float32", True), ("fp8", True), ("fp8", False)])
def test_offloaded_decode_in_cuda_graphs_equals_resident(tmp_path, monkeypatch, kv_dtype, staged):
    """A tiny engine, every context past dense_threshold: with offloading (pages moved one at a
    time, so the tables change during decode) the graphs produce the resident run's tokens; the
    prefill chunks after the first read the offloaded pages staged by the side stream
    (runtime/offload/staging.py) or in place."""
    from infhip import LLM, SamplingParams
    from infhip.builder.build import build_engine

    from .test_infinitehip_runtime import PROMPTS, TINY
    from ._offload import count_moves
    from ._tiny import write_tiny_hf_checkpoint

    monkeypatch.setattr(offload_policy, "OFFLOAD_BATCH_TOKENS", 16)
    write_tiny_hf_checkpoint(tmp_path / "hf", "llama")
    engine = build_engine(checkpoint=tmp_path / "hf", output_dir=tmp_path / "e", dtype="float32", device="cuda",
                          max_seq_len=400, max_batch_size=4, preset="3k", kv_dtype=kv_dtype,
                          infinitehip_overrides=dict(TINY, dense_threshold=30, rope_off_in_trained_window=False),
                          progress=False)
    sp = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    kw = dict(kv_cache_memory_bytes=1 << 26, max_num_batched_tokens=64)
    resident = LLM(engine, **kw)
    expected = [o.token_ids for o in resident.generate(prompt_token_ids=PROMPTS, sampling_params=sp)]
    offloaded = LLM(engine, kv_offload_bytes=1 << 26, **kw)
    offloaded.runner.staging.enabled = staged
    moved = count_moves(offloaded)
    got = [o.token_ids for o in offloaded.generate(prompt_token_ids=PROMPTS, sampling_params=sp)]
    captured = offloaded.debug_view()["graphs"]["captured"]
    assert len(moved) >= 20 and sum(g["backends"].get("infinitehip") is not None for g in captured) >= 2
    assert (offloaded.runner.staging.pages_staged > 0) == staged
    assert got == expected
