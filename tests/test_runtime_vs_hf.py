"""The dense runtime against Hugging Face transformers, on tiny random checkpoints of every
architecture (float32, CPU): last-token logits of a ~100-token prompt (whole and chunked
prefill), 32 greedy tokens, and a mixed batch through the scheduler equal to each request alone."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from infhip import LLM, SamplingParams
from infhip.builder.build import build_engine
from infhip.runtime.sequence import Sequence

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]
PROMPT_LEN = 101  # longer than the tiny Gemma-3's sliding window


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tiny_engine, tiny_checkpoint):
    src = tiny_checkpoint(request.param)
    hf_cfg = json.loads((src / "config.json").read_text())
    engine = tiny_engine(request.param, max_seq_len=256, max_batch_size=4)
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    return request.param, hf_cfg, engine, hf


def prompt_ids(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def last_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Run the prefill of one sequence through scheduler + runner; logits of its last token."""
    seq = Sequence(seq_id=10_000, prompt_token_ids=ids, params=SamplingParams(max_tokens=1))
    llm.scheduler.add(seq)
    while True:
        out = llm.scheduler.schedule()
        logits = llm.runner.execute(out)
        if out.chunks[0].needs_logits:
            llm.scheduler.finish(seq, "abort")
            return logits[0]
        llm.scheduler.update(out, {}, ())


@torch.no_grad()
def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """Plain greedy decoding with full recomputation (no generate() logits processors: those
    suppress EOS under min_new_tokens, which our ignore_eos does not)."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("budget", [256, 32])  # whole prefill, and chunks of 32 over paged context
def test_logits_match_transformers(tiny, budget):
    arch, hf_cfg, engine, hf = tiny
    ids = prompt_ids(0, PROMPT_LEN, hf_cfg["vocab_size"])
    llm = LLM(engine, max_num_batched_tokens=budget)
    ours = last_logits(llm, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    assert rel_err(ours, ref) <= 1e-4, arch


def test_greedy_tokens_match_transformers(tiny):
    arch, hf_cfg, engine, hf = tiny
    ids = prompt_ids(1, PROMPT_LEN, hf_cfg["vocab_size"])
    llm = LLM(engine)
    ours = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        max_tokens=32, temperature=0.0, ignore_eos=True))[0]
    assert ours.token_ids == hf_greedy(hf, ids, 32), arch
    assert ours.finish_reason == "length"


def test_batch_equals_alone(tiny):
    """Mixed-length requests joining one continuous batch (chunked prefill, decodes and prefills in
    the same step) give the same greedy tokens as each request alone."""
    arch, hf_cfg, engine, _ = tiny
    prompts = [prompt_ids(10 + i, n, hf_cfg["vocab_size"]) for i, n in enumerate([5, 40, 101, 17])]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (12, 7, 9, 15)]
    llm = LLM(engine, max_num_batched_tokens=48)
    together = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for ids, sp, out in zip(prompts, params, together):
        alone = llm.generate(prompt_token_ids=[ids], sampling_params=sp)[0]
        assert out.token_ids == alone.token_ids, arch
        assert len(out.token_ids) == sp.max_tokens


@pytest.fixture
def hf_with_fp8_kv(monkeypatch):
    """Make transformers' eager attention see K and V as an fp8 cache holds them: each row (token,
    kv head) quantized to float8_e4m3fn with its own scale and read back (plugins/kv_quant.py)."""
    import importlib

    from infhip.plugins.kv_quant import dequantize_rows, quantize_rows

    def fake_quant(x):
        return dequantize_rows(*quantize_rows(x), x.dtype)

    for arch in ARCHS:
        mod = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
        original = mod.eager_attention_forward
        monkeypatch.setattr(mod, "eager_attention_forward",
                            lambda module, q, k, v, *a, _f=original, **kw: _f(module, q, fake_quant(k), fake_quant(v), *a, **kw))


@pytest.mark.parametrize("budget", [256, 32])
def test_fp8_kv_cache_matches_transformers_on_quantized_kv(tiny, tmp_path, hf_with_fp8_kv, budget):
    """An engine built with --kv-dtype fp8 equals transformers whose attention reads K/V through
    the same per-row e4m3 quantization (so every key and value the runtime attends to, in whole
    or chunked prefill alike, is the cached fp8 one); and it differs from the unquantized model
    by what fp8 costs, not more."""
    arch, hf_cfg, _, hf = tiny
    engine = build_engine(checkpoint=hf.name_or_path, output_dir=tmp_path / "fp8", dtype="float32", kv_dtype="fp8",
                          device="cpu", max_seq_len=256, max_batch_size=4)
    ids = prompt_ids(0, PROMPT_LEN, hf_cfg["vocab_size"])
    llm = LLM(engine, max_num_batched_tokens=budget)
    assert llm.engine.model.layers[0].self_attn.kv.k.dtype == torch.float8_e4m3fn
    ours = last_logits(llm, ids)
    hf_eager = AutoModelForCausalLM.from_pretrained(hf.name_or_path, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf_eager(torch.tensor([ids])).logits[0, -1]
        exact = hf(torch.tensor([ids])).logits[0, -1]
    assert rel_err(ours, ref) <= 1e-4, arch
    assert 1e-6 < rel_err(ours, exact) <= 0.1, arch
