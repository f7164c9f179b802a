"""GPU checks at Llama-3.1-8B shapes (bf16): each plugin on its real sizes against the torch
reference, then a 2-layer 8B-shaped model against transformers. Skipped without a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from infhip.plugins.activation import gated_act_ref, gated_act_triton
from infhip.plugins.dense_attention import dense_attention_ref, paged_prefill_attention
from infhip.plugins.paged_kv import PagedKV
from infhip.plugins.rms_norm import rms_norm_ref, rms_norm_triton
from infhip.plugins.rope import apply_rope_, apply_rope_ref_

pytestmark = pytest.mark.gpu
T, HIDDEN, INTER, HQ, HKV, D = 1024, 4096, 14336, 32, 8, 128


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_norm_and_act_real_shapes():
    x = torch.randn(T, HIDDEN, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.rand(HIDDEN, device="cuda") + 0.5
    for got, ref in zip(rms_norm_triton(x, w, 1e-5, r), rms_norm_ref(x, w, 1e-5, r)):
        assert rel(got, ref) < 1e-2
    gu = torch.randn(T, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    assert rel(gated_act_triton(gu, "silu"), gated_act_ref(gu, "silu")) < 1e-2


def test_rope_and_prefill_attention_real_shapes():
    qkv = torch.randn(T, (HQ + 2 * HKV) * D, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, :HQ * D].view(T, HQ, D)
    k = qkv[:, HQ * D:(HQ + HKV) * D].view(T, HKV, D)
    v = qkv[:, (HQ + HKV) * D:].view(T, HKV, D)
    pos = torch.arange(T, device="cuda")
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    q_ref, k_ref = q.clone(), k.clone()
    apply_rope_ref_(q_ref, k_ref, pos, inv_freq, 1.0)
    apply_rope_(q, k, pos, inv_freq, 1.0)
    assert rel(q, q_ref) < 1e-2 and rel(k, k_ref) < 1e-2
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    ctx = torch.tensor([T], dtype=torch.int32, device="cuda")
    dummy = torch.zeros(1, 16, HKV, D, device="cuda", dtype=torch.bfloat16)
    out = paged_prefill_attention(q, PagedKV(dummy, dummy), torch.zeros(1, 1, dtype=torch.int32, device="cuda"),
                                  cu, ctx, D ** -0.5, None, k_new=k, v_new=v,
                                  cu_seqlens_q_list=[0, T], context_lens_list=[T])
    ref = dense_attention_ref(q.float(), k.float(), v.float(), pos, pos, D ** -0.5, None)
    assert rel(out, ref) < 2e-2


def test_two_layer_8b_shaped_model_matches_transformers(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from infhip import LLM, SamplingParams
    from infhip.builder.build import build_engine
    from infhip.builder.registry import bundled_config
    from infhip.runtime.sequence import Sequence

    cfg = json.loads(bundled_config("llama-3.1-8b").read_text())
    cfg["num_hidden_layers"] = 2
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16)  # init on CPU, as from_pretrained would
    hf.save_pretrained(tmp_path / "hf")
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).cuda().eval()
    engine = build_engine(checkpoint=tmp_path / "hf", output_dir=tmp_path / "engine", dtype="bfloat16",
                          device="cuda", max_seq_len=4096, max_batch_size=2, progress=False)
    llm = LLM(engine, kv_cache_memory_bytes=1 << 30)
    ids = torch.randint(10, 100000, (T,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = Sequence(seq_id=1, prompt_token_ids=ids, params=SamplingParams(max_tokens=1))
    llm.scheduler.add(seq)
    ours = llm.runner.execute(llm.scheduler.schedule())[0]
    llm.scheduler.finish(seq, "abort")
    with torch.no_grad():
        ref = hf(torch.tensor([ids], device="cuda"), logits_to_keep=1).logits[0, -1].float()
    assert rel(ours, ref) < 2e-2

    # Decode through CUDA graphs, 8 steps fused per host sync (batch 4 = a captured size), equals
    # the eager single-step path token for token.
    prompts = [torch.randint(10, 100000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (7, 300, 41, 1000)]
    sp = SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True)
    graphed = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]
    assert {g["len_bucket"] for g in llm.debug_view()["graphs"]["captured"]} >= {512, 2048}  # short-context graphs ran
    del llm
    eager = LLM(engine, kv_cache_memory_bytes=1 << 30, enforce_eager=True, num_decode_steps=1)
    assert graphed == [o.token_ids for o in eager.generate(prompt_token_ids=prompts, sampling_params=sp)]
