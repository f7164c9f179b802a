"""infhip-build: tiny random HF checkpoints of every architecture (tests/_tiny.py) built and
compared tensor by tensor with the HF originals, and the bundled model configs read in their
original (old-style) form and in transformers' normalised (new-style) form. GGUF checkpoints:
test_builder_gguf.py; atomic writes and the errors users see: test_builder_errors.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from infhip.builder import registry
from infhip.builder.convert import weight_specs
from infhip.builder.hf_config import hf_config_object, model_config_from_hf
from infhip.config import EngineConfig
from tests._builder import build, hf_tensors, run_cli, tiny  # noqa: F401 (tiny: a fixture)
from tests._tiny import ARCHS, write_tiny_hf_checkpoint

CONFIGS = sorted(p.stem for p in Path(registry.bundled_config("qwen3-8b")).parent.glob("*.json"))


def rotary_reference(cfg_dict: dict) -> dict[str, tuple[torch.Tensor, float]]:
    """inv_freq and attention scaling per layer type from transformers' own rotary module."""
    import importlib
    cfg = hf_config_object(cfg_dict)
    mt = cfg.model_type
    mod = importlib.import_module(f"transformers.models.{mt.removesuffix('_text')}.modeling_{mt.removesuffix('_text')}")
    cls = next(getattr(mod, n) for n in dir(mod) if n.endswith("RotaryEmbedding") and not n.startswith("_"))
    rot = cls(cfg)
    if hasattr(rot, "inv_freq"):
        return {"*": (rot.inv_freq, rot.attention_scaling)}
    return {lt: (getattr(rot, f"{lt}_inv_freq"), getattr(rot, f"{lt}_attention_scaling")) for lt in rot.layer_types}


# ------------------------------------------------------------------------------ tiny checkpoints

@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_build_round_trips(tiny, tmp_path, arch):
    src, hf_cfg = tiny[arch]
    out = build(src, tmp_path / "eng", max_seq_len=200, max_batch_size=12)
    cfg = EngineConfig.load(out)
    model, _ = model_config_from_hf(hf_cfg)
    assert cfg.model == model and cfg.model.architecture == arch
    assert cfg.build.cuda_graph_batch_sizes == (1, 2, 4, 8, 12)
    assert (cfg.build.max_seq_len, cfg.build.target, cfg.build.dtype) == (200, "cpu", "float32")
    assert [p.attention for p in cfg.plan.layers] == [
        "sliding" if t == "sliding_attention" else "global" for t in model.layer_types]
    assert json.loads((out / "kernels" / "index.json").read_text())["target"] == "cpu"
    report = json.loads((out / "build_report.json").read_text())
    assert report["num_parameters"] == sum(
        torch.Size(s.shape).numel() for s in weight_specs(model))
    assert report["sizes_bytes"]["rank0.safetensors"] == (out / "rank0.safetensors").stat().st_size
    assert not (out / "tokenizer").exists()  # the tiny checkpoints have none
    if arch == "gemma3":
        assert model.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
        assert model.sliding_window == 16 and model.attention_scale == 24 ** -0.5
        assert model.embedding_multiplier == 48 ** 0.5 and model.eos_token_ids == (2, 3)
    else:
        assert model.sliding_window is None and set(model.layer_types) == {"full_attention"}
    assert model.attention_bias == (arch == "qwen2") and model.qk_norm == (arch in ("qwen3", "gemma3"))


def test_cli_fp8_kv_cache(tiny, tmp_path, capsys):
    """--kv-dtype fp8 is recorded in the engine (weights stay in --dtype) and the runtime keeps
    float8_e4m3fn caches with float32 scales per token and kv head; an unknown KV dtype is a
    usage error."""
    from infhip import LLM

    src, _ = tiny["llama"]
    out = tmp_path / "fp8"
    rc, err = run_cli(capsys, "--checkpoint", src, "--output", out, "--device", "cpu", "--dtype", "float32",
                      "--kv-dtype", "fp8", "--max-seq-len", "64", "--quiet")
    assert rc == 0, err
    build = EngineConfig.load(out).build
    assert (build.dtype, build.kv_dtype) == ("float32", "fp8")
    attn = LLM(out).engine.model.layers[0].self_attn
    assert attn.kv.k.dtype == attn.kv.v.dtype == torch.float8_e4m3fn
    assert attn.kv.k_scale.dtype == torch.float32 and attn.kv.k_scale.shape == attn.kv.k.shape[:3]
    rc, err = run_cli(capsys, "--checkpoint", src, "--output", tmp_path / "x", "--kv-dtype", "int8")
    assert rc == 2 and "invalid choice" in err


@pytest.mark.parametrize("arch", ARCHS)
def test_converted_tensors_equal_hf(tiny, tmp_path, arch):
    src, hf_cfg = tiny[arch]
    out = build(src, tmp_path / "eng")
    ours, hf = load_file(str(out / "rank0.safetensors")), hf_tensors(src)
    model = EngineConfig.load(out).model
    expected = {s.name for s in weight_specs(model)} | {f"rope.{t}.inv_freq" for t in set(model.layer_types)}
    assert set(ours) == expected
    assert ("lm_head.weight" in ours) == (not hf_cfg["tie_word_embeddings"])
    offset = 1.0 if arch == "gemma3" else 0.0
    for i in range(model.num_layers):
        p = f"layers.{i}."
        qkv = ours[p + "self_attn.qkv_proj.weight"]
        q, k, v = qkv.split([model.q_size, model.kv_size, model.kv_size])
        for part, name in ((q, "q"), (k, "k"), (v, "v")):
            assert torch.equal(part, hf[p + f"self_attn.{name}_proj.weight"])
        if arch == "qwen2":
            assert torch.equal(ours[p + "self_attn.qkv_proj.bias"], torch.cat(
                [hf[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]))
        gate, up = ours[p + "mlp.gate_up_proj.weight"].chunk(2)
        assert torch.equal(gate, hf[p + "mlp.gate_proj.weight"]) and torch.equal(up, hf[p + "mlp.up_proj.weight"])
        for n in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            assert torch.equal(ours[p + n], hf[p + n])
        norms = ["input_layernorm", "post_attention_layernorm"]
        norms += ["self_attn.q_norm", "self_attn.k_norm"] if model.qk_norm else []
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if arch == "gemma3" else []
        for n in norms:
            w = ours[p + n + ".weight"]
            assert w.dtype == torch.float32 and torch.equal(w, hf[p + n + ".weight"] + offset), n
    assert torch.equal(ours["norm.weight"], hf["norm.weight"] + offset)
    assert torch.equal(ours["embed_tokens.weight"], hf["embed_tokens.weight"])
    if "lm_head.weight" in ours:
        assert torch.equal(ours["lm_head.weight"], hf["lm_head.weight"])
    for lt, (inv_freq, scaling) in rotary_reference(hf_cfg).items():
        key = lt if lt != "*" else model.layer_types[0]
        assert torch.allclose(ours[f"rope.{key}.inv_freq"], inv_freq.float(), rtol=1e-6, atol=0)
        assert model.rope[key].attention_scaling == pytest.approx(scaling)


def test_sharded_checkpoint_equals_single_file(tiny, tmp_path):
    src, _ = tiny["qwen2"]
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / file))
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    a = load_file(str(build(sharded, tmp_path / "a") / "rank0.safetensors"))
    b = load_file(str(build(src, tmp_path / "b") / "rank0.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bfloat16_casts_matrices_keeps_norms_float32(tiny, tmp_path):
    src, _ = tiny["gemma3"]
    ours = load_file(str(build(src, tmp_path / "eng", dtype="bfloat16") / "rank0.safetensors"))
    hf = hf_tensors(src)
    assert ours["layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(ours["layers.0.mlp.down_proj.weight"], hf["layers.0.mlp.down_proj.weight"].bfloat16())
    assert ours["layers.0.input_layernorm.weight"].dtype == torch.float32
    assert ours["rope.full_attention.inv_freq"].dtype == torch.float32


def test_multimodal_gemma3_checkpoint_uses_its_language_model(tiny, tmp_path):
    src, hf_cfg = tiny["gemma3"]
    mm = tmp_path / "mm"
    mm.mkdir()
    tensors = {f"model.language_model.{k}": v for k, v in hf_tensors(src).items()}
    tensors["model.vision_tower.patch_embedding.weight"] = torch.zeros(4, 3)
    save_file(tensors, str(mm / "model.safetensors"))
    text = {k: v for k, v in hf_cfg.items() if k not in ("architectures",)}
    (mm / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text,
                                                "architectures": ["Gemma3ForConditionalGeneration"]}))
    ours = load_file(str(build(mm, tmp_path / "eng") / "rank0.safetensors"))
    ref = load_file(str(build(src, tmp_path / "ref") / "rank0.safetensors"))
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)


def test_hf_directory_tokenizer_is_saved_and_reloads_identically(tmp_path):
    from transformers import AutoTokenizer
    src = tmp_path / "hf"
    write_tiny_hf_checkpoint(src, "qwen3", tokenizer=True)
    out = build(src, tmp_path / "eng")
    ours, theirs = AutoTokenizer.from_pretrained(str(out / "tokenizer")), AutoTokenizer.from_pretrained(str(src))
    text = "And God said, Let there be light: naïve 東京 🙂\n\n  x"
    assert ours.encode(text) == theirs.encode(text) and ours.decode(ours.encode(text)) == text
    assert len(ours.encode("the earth was without form")) < 20  # merges survived
    assert ours.eos_token_id == 2 and ours.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False) == "<s>user: hi</s>"
    assert json.loads((out / "build_report.json").read_text())["warnings"] == []


def test_random_weights_from_a_bare_config(tiny, tmp_path):
    src, _ = tiny["gemma3"]
    a = build(src / "config.json", tmp_path / "a", random_weights=True, dtype="bfloat16")
    b = build(src / "config.json", tmp_path / "b", random_weights=True, dtype="bfloat16")
    wa, wb = load_file(str(a / "rank0.safetensors")), load_file(str(b / "rank0.safetensors"))
    model = EngineConfig.load(a).model
    assert EngineConfig.load(a).build.random_weights
    for s in weight_specs(model):
        assert tuple(wa[s.name].shape) == s.shape and torch.equal(wa[s.name], wb[s.name])
    assert torch.equal(wa["norm.weight"], torch.ones(48))  # Gemma's 1 + 0, folded
    assert wa["embed_tokens.weight"].float().std().item() == pytest.approx(0.02, rel=0.05)
    assert not (a / "tokenizer").exists()


# ------------------------------------------------------------------------------ configs

@pytest.mark.parametrize("name", CONFIGS)
def test_old_and_new_style_configs_agree(name):
    old = json.loads(registry.bundled_config(name).read_text())
    new = hf_config_object(old).to_dict()  # rope_parameters + layer_types, as transformers 5 writes
    assert "rope_parameters" in new and "rope_scaling" not in new
    (m_old, f_old), (m_new, f_new) = model_config_from_hf(old), model_config_from_hf(new)
    assert m_old == m_new and f_old.keys() == f_new.keys()
    assert all(torch.equal(f_old[k], f_new[k]) for k in f_old)
    for lt, (inv_freq, scaling) in rotary_reference(old).items():
        key = lt if lt != "*" else next(t for t in m_old.layer_types if t in m_old.rope)  # not a linear layer
        # partial RoPE (Qwen3-Next): the rotary dims' frequencies, then zeros (builder/qwen3_next.py)
        rotary = inv_freq.shape[0]
        assert torch.allclose(f_old[key][:rotary], inv_freq.float(), rtol=1e-6, atol=0), (name, lt)
        assert not f_old[key][rotary:].any(), (name, lt)
        assert m_old.rope[key].attention_scaling == pytest.approx(scaling)


def test_published_shapes():
    cfg = {n: model_config_from_hf(json.loads(registry.bundled_config(n).read_text()))[0] for n in CONFIGS}
    g27, g1, l8 = cfg["gemma-3-27b"], cfg["gemma-3-1b"], cfg["llama-3.1-8b"]
    assert g27.attention_scale == 168 ** -0.5 and g27.head_dim == 128 and g27.num_layers == 62
    assert g27.rope["full_attention"].rope_type == "linear" and g27.rope["sliding_attention"].rope_theta == 10000.0
    assert g1.sliding_window == 512 and cfg["gemma-3-4b"].sliding_window == 1024
    assert g1.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)
    assert (l8.num_heads, l8.num_kv_heads, l8.intermediate_size, l8.rope["full_attention"].rope_type) == (
        32, 8, 14336, "llama3")
    assert cfg["qwen2.5-7b"].attention_bias and cfg["qwen3-8b"].qk_norm and cfg["qwen3-8b"].head_dim == 128
    assert cfg["mistral-7b"].sliding_window is None and cfg["llama-3.2-1b"].tie_word_embeddings


def test_sliding_window_flags_follow_transformers():
    base = json.loads(registry.bundled_config("mistral-7b").read_text())
    m, _ = model_config_from_hf({**base, "sliding_window": 4096})
    assert set(m.layer_types) == {"sliding_attention"} and m.sliding_window == 4096
    q = json.loads(registry.bundled_config("qwen2.5-7b").read_text())
    m, _ = model_config_from_hf({**q, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 20})
    assert m.layer_types == ("full_attention",) * 20 + ("sliding_attention",) * 8 and m.sliding_window == 4096


def test_cli_default_output_folder(tiny, tmp_path, capsys, monkeypatch):
    """Without --output the engine goes to engines/<model>[-<preset>] under the current directory
    and the CLI prints that path; --model names the folder by its last path part."""
    from infhip.builder.cli import default_output, main

    src, _ = tiny["llama"]
    monkeypatch.chdir(tmp_path)
    for preset, folder in (("dense", "llama"), ("3k", "llama-3k")):
        rc = main(["--checkpoint", str(src), "--preset", preset, "--device", "cpu", "--dtype", "float32",
                   "--max-seq-len", "64", "--quiet"])
        out, err = capsys.readouterr()
        assert rc == 0, err
        assert EngineConfig.load(tmp_path / "engines" / folder).build.max_seq_len == 64
        assert f"engine written to engines/{folder}:" in out
    assert default_output("gemma-3-12b", None, "3k-flash") == Path("engines/gemma-3-12b-3k-flash")
    assert default_output("Qwen/Qwen2.5-7B-Instruct", None, "dense") == Path("engines/Qwen2.5-7B-Instruct")
    assert default_output(None, str(src / "config.json"), "5k") == Path("engines/llama-5k")
