"""FP8-weight engines end to end on CPU (tiny random checkpoints, float32 activations).

The builder writes fp8 weights with per-channel scales and refuses bad values; an fp8 engine
loads (Fp8Linear at the same module paths) and generates; its logits equal, to float32
rounding, those of the same model whose weights were replaced by their dequantized values (the
fp8 engine computes exactly that model); the fp8 kernel paths inside the model (forced on) agree
with it too; engines written before the field load as bf16.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from infhip import LLM, SamplingParams
from infhip.builder import BuildError, build_engine
from infhip.config import EngineConfig
from infhip.plugins import fp8_linear as fl
from infhip.runtime import engine as engine_mod
from infhip.runtime.models.common import Fp8Linear
from tests._tiny import write_tiny_hf_checkpoint
from tests._builder import assert_one_line_error, run_cli
from tests.test_runtime_vs_hf import last_logits, prompt_ids, rel_err

KW = dict(dtype="float32", device="cpu", max_seq_len=256, max_batch_size=4, progress=False)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8w")
    return {arch: (root / arch, write_tiny_hf_checkpoint(root / arch, arch)) for arch in ("llama", "gemma3", "qwen2")}


def dequantized_twin(fp8_engine, bf16_engine, out):
    """A copy of the float32 engine whose fp8 layers hold the fp8 engine's weights, dequantized."""
    import shutil
    shutil.copytree(bf16_engine, out)
    ours = load_file(str(fp8_engine / "rank0.safetensors"))
    twin = load_file(str(out / "rank0.safetensors"))
    for name in EngineConfig.load(fp8_engine).fp8_linears():
        assert ours[f"{name}.weight"].dtype == torch.float8_e4m3fn
        twin[f"{name}.weight"] = ours[f"{name}.weight"].float() * ours[f"{name}.weight_scale"][:, None]
    save_file(twin, str(out / "rank0.safetensors"))
    return out


def test_builder_writes_fp8_weights_and_scales(ckpts, tmp_path):
    src, cfg = ckpts["llama"]
    out = build_engine(checkpoint=src, output_dir=tmp_path / "e", weight_dtype="fp8", **KW)
    config = EngineConfig.load(out)
    assert config.build.weight_dtype == "fp8" and not config.build.quantize_lm_head
    assert json.loads((out / "config.json").read_text())["build"]["weight_dtype"] == "fp8"
    t = load_file(str(out / "rank0.safetensors"))
    for layer in range(cfg["num_hidden_layers"]):
        for name in LINEARS:
            w, s = t[f"layers.{layer}.{name}.weight"], t[f"layers.{layer}.{name}.weight_scale"]
            assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (w.shape[0],)
            assert torch.allclose(w.float().abs().amax(1), torch.tensor(448.0))  # amax / 448 per channel
    # embeddings, norms, LM head (not asked for) stay in the build dtype / float32
    assert t["embed_tokens.weight"].dtype == t["lm_head.weight"].dtype == torch.float32
    assert t["norm.weight"].dtype == t["layers.0.input_layernorm.weight"].dtype == torch.float32
    assert "lm_head.weight_scale" not in t
    report = json.loads((out / "build_report.json").read_text())
    assert report["weight_dtype"] == "fp8"


def test_quantized_tied_lm_head_gets_its_own_fp8_copy(ckpts, tmp_path):
    src, cfg = ckpts["gemma3"]
    assert cfg["tie_word_embeddings"]
    out = build_engine(checkpoint=src, output_dir=tmp_path / "e", weight_dtype="fp8", quantize_lm_head=True, **KW)
    t = load_file(str(out / "rank0.safetensors"))
    assert t["embed_tokens.weight"].dtype == torch.float32
    assert t["lm_head.weight"].dtype == torch.float8_e4m3fn and t["lm_head.weight_scale"].shape == (cfg["vocab_size"],)
    deq = t["lm_head.weight"].float() * t["lm_head.weight_scale"][:, None]
    assert rel_err(deq, t["embed_tokens.weight"]) < 0.05
    llm = LLM(out)
    assert isinstance(llm.engine.model.lm_head, Fp8Linear)
    assert len(llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY)[0].token_ids) == 12


def test_bad_values_are_refused(ckpts, tmp_path, capsys):
    src, _ = ckpts["llama"]
    with pytest.raises(BuildError, match="--weight-dtype must be one of bf16, fp8"):
        build_engine(checkpoint=src, output_dir=tmp_path / "a", weight_dtype="int4", **KW)
    with pytest.raises(BuildError, match="quantize_lm_head needs weight_dtype fp8"):
        build_engine(checkpoint=src, output_dir=tmp_path / "b", quantize_lm_head=True, **KW)
    rc, err = run_cli(capsys, "--checkpoint", src, "--output", tmp_path / "c", "--device", "cpu", "--weight-dtype", "int4")
    assert rc == 2 and "invalid choice: 'int4'" in err and err.strip().splitlines()[-1].startswith("infhip-build: error")
    rc, err = run_cli(capsys, "--checkpoint", src, "--output", tmp_path / "d", "--device", "cpu", "--quantize-lm-head")
    assert_one_line_error(rc, err, "--weight-dtype fp8")
    assert not any((tmp_path / n).exists() for n in "abcd")


@pytest.mark.parametrize("arch,lm_head", [("llama", True), ("gemma3", False), ("qwen2", False)])
def test_logits_equal_the_dequantized_model(ckpts, tmp_path, arch, lm_head):
    """Llama (LM head quantized, untied), Gemma-3 (tied, 1 + w norms, sliding layers) and Qwen2 (qkv
    bias): prefill logits and greedy decode equal the dequantized twin's; against the original
    float32 model they differ by the fp8 rounding of the weights only."""
    src, cfg = ckpts[arch]
    ref = build_engine(checkpoint=src, output_dir=tmp_path / "f32", **KW)
    fp8 = build_engine(checkpoint=src, output_dir=tmp_path / "fp8", weight_dtype="fp8", quantize_lm_head=lm_head, **KW)
    twin = dequantized_twin(fp8, ref, tmp_path / "twin")
    ids = prompt_ids(0, 101, cfg["vocab_size"])
    llm_fp8, llm_twin, llm_ref = LLM(fp8), LLM(twin), LLM(ref)
    assert isinstance(llm_fp8.engine.model.layers[0].mlp.down_proj, Fp8Linear)
    ours = last_logits(llm_fp8, ids)
    assert rel_err(ours, last_logits(llm_twin, ids)) < 1e-6
    # fp8 rounding of the weights: there, and small (a wrong scale or layout is ~1.4)
    assert 1e-4 < rel_err(ours, last_logits(llm_ref, ids)) < 0.25
    gen = [llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY)[0].token_ids for llm in (llm_fp8, llm_twin)]
    assert gen[0] == gen[1]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fp8_kernel_paths_in_the_model(ckpts, tmp_path, monkeypatch, arch):
    """With the fp8 fast paths forced on (as on an sm_89+ GPU; Triton's interpreter here): a
    12-token prompt runs every linear layer through the skinny kernel (x unquantized: float32
    rounding from the twin), a 40-token one through per-token fp8 activations and the
    scaled_mm product (their fp8 rounding on top)."""
    src, cfg = ckpts[arch]
    lm_head = not cfg["tie_word_embeddings"]  # (a quantized tied head has no dequantized twin)
    ref = build_engine(checkpoint=src, output_dir=tmp_path / "f32", **KW)
    fp8 = build_engine(checkpoint=src, output_dir=tmp_path / "fp8", weight_dtype="fp8", quantize_lm_head=lm_head, **KW)
    llm_twin = LLM(dequantized_twin(fp8, ref, tmp_path / "twin"))
    llm = LLM(fp8)
    monkeypatch.setattr(fl, "_fast_device", lambda x: True)
    calls = []
    real = fl.fp8_skinny_gemm_triton
    monkeypatch.setattr(fl, "fp8_skinny_gemm_triton", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    short, long = prompt_ids(1, 12, cfg["vocab_size"]), prompt_ids(2, 40, cfg["vocab_size"])
    assert rel_err(last_logits(llm, short), last_logits(llm_twin, short)) < 1e-5
    assert set(calls) == ({12, 1} if lm_head else {12})  # the prompt's rows; the LM head's sampled row
    assert rel_err(last_logits(llm, long), last_logits(llm_twin, long)) < 0.1


def test_engine_without_the_field_loads_as_bf16(ckpts, tmp_path):
    src, _ = ckpts["llama"]
    out = build_engine(checkpoint=src, output_dir=tmp_path / "old", **KW)
    before = LLM(out).generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY)[0].token_ids
    d = json.loads((out / "config.json").read_text())
    del d["build"]["weight_dtype"], d["build"]["quantize_lm_head"]
    (out / "config.json").write_text(json.dumps(d))
    config = EngineConfig.load(out)
    assert config.build.weight_dtype == "bf16" and config.fp8_linears() == ()
    assert LLM(out).generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY)[0].token_ids == before


def test_gpu_without_fp8_warns_once_and_runs_the_reference(monkeypatch, caplog):
    """Below sm_89 an fp8 engine loads with one warning; its layers then take the reference path
    (fp8_linear asks device_has_fp8, tests/test_fp8_skinny_gemm.py)."""
    config = type("C", (), {"build": type("B", (), {"weight_dtype": "fp8"})})()
    monkeypatch.setattr(fl, "device_has_fp8", lambda device: False)
    monkeypatch.setattr(engine_mod, "gpu_target", lambda device: "sm_80")
    with caplog.at_level(logging.WARNING, logger="infhip.engine"):
        engine_mod._check_fp8_device(config, torch.device("cuda"))
        engine_mod._check_fp8_device(config, torch.device("cpu"))
    assert len(caplog.records) == 1 and "sm_80" in caplog.text and "dequantizing" in caplog.text


def _same_tokens_as_twin(src, tmp_path, prompts, max_tokens, build, load, before_twin=lambda: None):
    ref = build_engine(checkpoint=src, output_dir=tmp_path / "f32", **KW, **build)
    fp8 = build_engine(checkpoint=src, output_dir=tmp_path / "fp8", weight_dtype="fp8", **KW, **build)
    twin = dequantized_twin(fp8, ref, tmp_path / "twin")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    gen = []
    for e in (fp8, twin):
        if e == twin:
            before_twin()
        gen.append([o.token_ids for o in LLM(e, max_num_batched_tokens=48, **load).generate(
            prompt_token_ids=prompts, sampling_params=params)])
    assert gen[0] == gen[1]


def test_fp8_weights_compose_with_fp8_kv_and_token_drop(ckpts, tmp_path):
    """An fp8 KV cache and token drop (in 48-token prefill chunks) change nothing about the
    weights: greedy tokens equal the dequantized twin's."""
    from tests.test_aot_coverage import LONG

    build = dict(kv_dtype="fp8", token_drop=dict(p=0.9, min_prompt_len=32, obs_window=8, block_size=8, num_sink=8))
    _same_tokens_as_twin(ckpts["llama"][0], tmp_path, [LONG[:100], LONG[:41]], 12, build, {})


@pytest.mark.slow  # ~25 s: the fp8 engine's sparse-path kernels run in Triton's interpreter
def test_fp8_weights_compose_with_sparse_preset_and_offload(ckpts, tmp_path, monkeypatch):
    """The 3k preset (tiny stages: a 45-token prompt goes sparse) with an fp8 KV cache offloaded
    to host memory: greedy tokens equal the dequantized twin's. The twin runs the plugins' torch
    references: on CPU the linear layers never reach a kernel, so the interpreted twin launched
    only kernel variants the fp8 engine launches too (18 of its 21, recorded 2026-12-05), and
    its tokens were the references' (so kernels against references is asserted on top)."""
    from tests.test_aot_coverage import LONG, TINY

    build = dict(preset="3k", infinitehip_overrides=TINY, kv_dtype="fp8")
    _same_tokens_as_twin(ckpts["llama"][0], tmp_path, [LONG[:45]], 3, build, dict(kv_offload_bytes=4 << 20),
                         before_twin=lambda: monkeypatch.delenv("TRITON_INTERPRET", raising=False))
