"""Qwen3-Next (gated DeltaNet + gated full attention 3:1, sparse MoE with a shared expert) against
transformers on a tiny random checkpoint (float32, CPU; builder/tiny_checkpoint.py "qwen3_next":
hidden 64, layers L L L F, 6 experts top-2, layer 1 a dense MLP, partial RoPE): last-token
logits of a 101-token prompt whole and in scheduler chunks of 32 (which split the delta rule's
64-token chunks), greedy tokens, a batch of three prompts of different lengths; what the family
refuses at build and load."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from infhip import LLM, SamplingParams
from infhip.builder.build import build_engine
from infhip.errors import BuildError
from tests.test_runtime_vs_hf import hf_greedy, last_logits, prompt_ids, rel_err

PROMPT_LEN = 101  # two of the delta rule's 64-token chunks


@pytest.fixture(scope="module")
def tiny(tiny_engine, tiny_checkpoint):
    src = tiny_checkpoint("qwen3_next")
    hf_cfg = json.loads((src / "config.json").read_text())
    engine = tiny_engine("qwen3_next", max_seq_len=256, max_batch_size=4)
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    return hf_cfg, engine, hf


def test_engine_config_reads_the_hybrid(tiny):
    hf_cfg, engine, _ = tiny
    cfg = json.loads((engine / "config.json").read_text())
    model = cfg["model"]
    assert hf_cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert [lp["attention"] for lp in cfg["plan"]["layers"]] == ["linear", "linear", "linear", "global"]
    assert model["rotary_dim"] == 4 and model["attn_output_gate"]
    assert model["moe"]["layers"] == [0, 2, 3] and model["moe"]["top_k"] == 2
    assert model["linear_attention"]["num_value_heads"] == 4


@pytest.mark.parametrize("budget", [256, 32])  # whole prefill; chunks of 32 (a delta-rule chunk split)
def test_logits_match_transformers(tiny, budget):
    hf_cfg, engine, hf = tiny
    ids = prompt_ids(0, PROMPT_LEN, hf_cfg["vocab_size"])
    llm = LLM(engine, max_num_batched_tokens=budget)
    ours = last_logits(llm, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    assert rel_err(ours, ref) <= 1e-4


def test_greedy_and_batch_match_transformers(tiny):
    """Greedy tokens of one prompt, and of three prompts of different lengths sharing steps
    (chunked prefill beside decodes, budget 48), each equal to transformers' greedy decoding."""
    hf_cfg, engine, hf = tiny
    v = hf_cfg["vocab_size"]
    ids = prompt_ids(1, PROMPT_LEN, v)
    llm = LLM(engine)
    ours = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert ours.token_ids == hf_greedy(hf, ids, 8)
    prompts = [prompt_ids(10 + i, n, v) for i, n in enumerate([5, 40, 70])]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (6, 4, 5)]
    llm = LLM(engine, max_num_batched_tokens=48)
    for p, sp, out in zip(prompts, params, llm.generate(prompt_token_ids=prompts, sampling_params=params)):
        assert out.token_ids == hf_greedy(hf, p, sp.max_tokens)


def test_prefix_caching_is_refused(tiny, caplog):
    _, engine, _ = tiny
    with caplog.at_level(logging.WARNING, logger="infhip"):
        llm = LLM(engine)
    assert not llm.core.prefix_caching
    assert "recurrent state" in caplog.text


@pytest.mark.parametrize("kwargs, says", [
    (dict(preset="3k"), "--preset 3k"),
    (dict(tp=2), "--tp 2"),
    (dict(weight_dtype="fp8"), "--weight-dtype fp8"),
])
def test_unsupported_builds_are_refused(tiny_checkpoint, tmp_path, kwargs, says):
    with pytest.raises(BuildError, match="qwen3_next") as e:
        build_engine(checkpoint=tiny_checkpoint("qwen3_next"), output_dir=tmp_path / "e", dtype="float32",
                     device="cpu", progress=False, **kwargs)
    assert says in str(e.value)


def test_logits_match_transformers_through_the_triton_kernels(tiny, monkeypatch):
    """A chunked prefill with the linear layers' conv and delta rule (the chunked form) and the
    MoE experts in their Triton kernels (interpreted on the CPU), as a GPU runs them."""
    from infhip.plugins import causal_conv, gated_delta, moe

    for mod in (causal_conv, gated_delta, moe):
        monkeypatch.setattr(mod, "use_triton", lambda *t: True)
    hf_cfg, engine, hf = tiny
    ids = prompt_ids(0, 40, hf_cfg["vocab_size"])  # the interpreter is slow: 40 tokens, chunks of 16
    ours = last_logits(LLM(engine, max_num_batched_tokens=16), ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    assert rel_err(ours, ref) <= 1e-4


def _three_prompts(v: int):
    prompts = [prompt_ids(20 + i, n, v) for i, n in enumerate([7, 30, 19])]
    return prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_decode_graph_inputs_equal_eager_steps(tiny, monkeypatch):
    """The CUDA-graph path without CUDA (tests/_graph_sim.py): decode steps staged into the graphs'
    static buffers (the recurrent slots a row of them; three sequences padded to a graph of 4,
    the padding row on the scratch slot) give the eager steps' tokens."""
    from tests._graph_sim import simulate_graphs

    hf_cfg, engine, _ = tiny
    prompts, sp = _three_prompts(hf_cfg["vocab_size"])
    eager = [o.token_ids for o in LLM(engine).generate(prompt_token_ids=prompts, sampling_params=sp)]
    llm = LLM(engine)
    keys, _ = simulate_graphs(llm, monkeypatch)
    assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)] == eager
    assert keys


@pytest.mark.gpu
def test_decode_graphs_replay_on_the_gpu(tiny_checkpoint, tmp_path):
    """On a GPU (bf16, the Triton kernels): graph-replayed decode gives the eager engine's tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    engine = build_engine(checkpoint=tiny_checkpoint("qwen3_next"), output_dir=tmp_path / "e", dtype="bfloat16",
                          device="cuda", max_seq_len=256, max_batch_size=4, progress=False)
    prompts, sp = _three_prompts(300)
    eager = [o.token_ids for o in LLM(engine, enforce_eager=True).generate(prompt_token_ids=prompts, sampling_params=sp)]
    llm = LLM(engine)
    assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)] == eager
    assert llm.debug_view()["graphs"]["report"]["on_request"] == 0


def test_preempted_sequences_rebuild_their_state(tiny):
    """KV pages for two of three sequences (18 pages: one of 256 tokens; each needs 9): some are
    preempted (pages and recurrent slot given back) and recomputed from token 0; tokens equal a
    roomy engine's."""
    hf_cfg, engine, _ = tiny
    prompts = [prompt_ids(30 + i, 125, hf_cfg["vocab_size"]) for i in range(3)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LLM(engine).generate(prompt_token_ids=prompts, sampling_params=sp)]
    # one full-attention layer: a page is 16 tokens x 2 kv heads x 16 dims x (k, v) x 4 bytes
    small = LLM(engine, max_num_seqs=3, max_num_batched_tokens=64, kv_cache_memory_bytes=18 * 4096)
    assert [o.token_ids for o in small.generate(prompt_token_ids=prompts, sampling_params=sp)] == want
    assert small.scheduler.num_preemptions > 0


@pytest.mark.gpu
def test_gpu_kernels_match_transformers(tiny, tiny_checkpoint, tmp_path):
    """A float32 engine on the GPU (every new kernel compiled, fp32 dots exact): the chunked
    prefill's last logits and the greedy tokens equal transformers' on the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    hf_cfg, _, hf = tiny
    engine = build_engine(checkpoint=tiny_checkpoint("qwen3_next"), output_dir=tmp_path / "e", dtype="float32",
                          device="cuda", max_seq_len=256, max_batch_size=4, progress=False)
    ids = prompt_ids(0, PROMPT_LEN, hf_cfg["vocab_size"])
    llm = LLM(engine, max_num_batched_tokens=32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    assert rel_err(last_logits(llm, ids).cpu(), ref) <= 1e-4
    out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=8, temperature=0.0,
                                                                              ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, ids, 8)
