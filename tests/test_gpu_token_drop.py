"""GPU checks of UniPrefill token drop: the kept-query attention kernel at Llama-3.1-8B head
shapes (bf16) against the float64 reference, and a tiny float32 engine on the GPU (Triton
importance, selection and kept attention) against the plain-torch masked reference, decode
included. Skipped without a GPU. The engines are built with the token-drop plan the test loads them
with, so they hold its kernels (strict runs: INFHIP_JIT=forbid refuses a variant the engine lacks;
turning token drop on only at load worked before only when an earlier test, launching outside an
engine's steps, had left the variant in Triton's in-process cache)."""

from __future__ import annotations

import pytest
import torch

from infhip import LLM
from infhip.builder.build import build_engine
from infhip.eval.common import record_kept_positions, set_forced_retention
from infhip.plugins.dense_attention import dense_attention_ref
from infhip.plugins.token_drop.attention import kept_attention_triton
from infhip.eval.token_drop_reference import reference_logits, reference_schedule, run_greedy, token_drop_view
from tests._tiny import write_tiny_hf_checkpoint
from tests.test_token_drop_attention import kept_positions
from tests.test_token_drop_runtime import GEMMA_TYPES, TINY, prompt

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("window", [None, 1024])
def test_kept_attention_8b_heads(window):
    n, hq, hkv, d = 4096, 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q_pos = kept_positions(n, 64, seed=1, tail=max(128, window or 0))
    k_pos = torch.arange(n) if window is None else q_pos
    q = torch.randn(q_pos.numel(), hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(k_pos.numel(), hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(k_pos.numel(), hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
    got = kept_attention_triton(q, q_pos, k, v, k_pos, d ** -0.5, window)
    ref = dense_attention_ref(q, k, v, q_pos.cuda(), k_pos.cuda(), d ** -0.5, window)
    assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_engine_on_gpu_equals_masked_reference(arch, tmp_path):
    """Every full-attention layer drops (the default k = 6..7 eighths of a 3-layer model is its
    last layer only, whose drop no later row reads)."""
    drop = dict(TINY, drop_layers="every")
    extra = dict(num_hidden_layers=6, layer_types=GEMMA_TYPES) if arch == "gemma3" else {}
    write_tiny_hf_checkpoint(tmp_path / "hf", arch, **extra)
    engine = build_engine(checkpoint=tmp_path / "hf", output_dir=tmp_path / "e", dtype="float32",
                          device="cuda", max_seq_len=256, max_batch_size=4, token_drop=drop,
                          progress=False)
    ids = prompt(2, 200)
    llm = set_forced_retention(LLM(engine, max_num_batched_tokens=100, token_drop=drop, enforce_eager=True), 0.3)
    kept_positions = record_kept_positions(llm)
    tokens, logits, sid = run_greedy(llm, ids, 5)
    kept = {layer: torch.cat(c) for layer, c in kept_positions[sid].items()}
    assert all(len(kept[layer]) < 0.6 * len(ids) for layer in reference_schedule(llm)["layers"])  # really dropped
    layers = llm.engine.config.plan.layers
    ref = reference_logits(llm.engine.model, ids + tokens[:-1], len(ids), kept, layers,
                           schedule=reference_schedule(llm))[len(ids) - 1:]
    assert (logits.double() - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_drop_history_decode_through_cuda_graphs_equals_eager(arch, tmp_path):
    """Requests that dropped tokens decode through the per-layer-KV graphs (per-layer KV lengths and
    compact slots computed inside the graph; 8 steps fused per sync; batches of 1-3 padded to
    captured sizes) and give the eager path's tokens; the graphs did run."""
    extra = dict(num_hidden_layers=6, layer_types=GEMMA_TYPES) if arch == "gemma3" else {}
    write_tiny_hf_checkpoint(tmp_path / "hf", arch, **extra)
    engine = build_engine(checkpoint=tmp_path / "hf", output_dir=tmp_path / "e", dtype="float32",
                          device="cuda", max_seq_len=256, max_batch_size=4, token_drop=TINY,
                          progress=False)
    prompts = [prompt(s, n) for s, n in ((2, 200), (3, 150), (4, 170))]
    graphed, eager, keys = graphed_and_eager(engine, prompts, 0.3, max_num_batched_tokens=100, token_drop=TINY)
    assert any(k["kv_shift"] and k["backends"].get("infinitehip") is None for k in keys)
    assert graphed == eager


def test_token_drop_with_infinitehip_graphs_equal_eager(tmp_path):
    """Token-drop prefill, then InfiniteHiP decode over the compacted per-layer KV through CUDA
    graphs keyed by (sparse key, drop histories) equals the eager path token for token."""
    from .test_infinitehip_runtime import TINY as IHIP_TINY

    write_tiny_hf_checkpoint(tmp_path / "hf", "llama")
    engine = build_engine(checkpoint=tmp_path / "hf", output_dir=tmp_path / "e", dtype="float32", device="cuda",
                          max_seq_len=256, max_batch_size=4, preset="3k",
                          infinitehip_overrides=dict(IHIP_TINY, dense_threshold=30),
                          token_drop=TINY, progress=False)
    prompts = [prompt(s, n) for s, n in ((5, 150), (6, 97), (7, 181))]
    graphed, eager, keys = graphed_and_eager(engine, prompts, 0.4, max_num_batched_tokens=64, token_drop=TINY)
    assert any(k["kv_shift"] and k["backends"].get("infinitehip") is not None for k in keys)
    assert graphed == eager


def graphed_and_eager(engine, prompts, retention, **llm_kwargs):
    """Greedy tokens (40 each) through the CUDA graphs and eagerly (a forced retention), and the
    graphs the graphed run captured (EngineCore.debug_view); both runs must have dropped tokens."""
    from infhip import SamplingParams

    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs, keys = {}, []
    for eager in (False, True):
        llm = set_forced_retention(LLM(engine, enforce_eager=eager, **llm_kwargs), retention)
        outs[eager] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]
        assert token_drop_view(llm)["retention"]
        if not eager:
            keys = llm.debug_view()["graphs"]["captured"]
    return outs[False], outs[True], keys
