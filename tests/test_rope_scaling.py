"""`infhip-build --rope-scaling TYPE:FACTOR` (builder/hf_config.with_rope_scaling): the engine
equals transformers running the same checkpoint with the model card's rope_scaling recipe in its
config (YaRN and linear, whole and chunked prefill, float32 CPU), and differs from the unscaled
model; bad specs and checkpoints that already scale RoPE are refused with a clear error."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from infhip import LLM
from infhip.builder.build import build_engine
from infhip.builder.cli import main as build_main
from infhip.builder.hf_config import BuildError
from infhip.config import EngineConfig
from tests._tiny import write_tiny_hf_checkpoint
from tests.test_runtime_vs_hf import last_logits, prompt_ids, rel_err


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("rope_scaling")
    cfg = write_tiny_hf_checkpoint(root / "hf", "qwen2")
    return root, cfg


def hf_model(path, **config):
    c = AutoConfig.from_pretrained(path, **config)  # through __init__: rope_scaling -> rope_parameters
    return AutoModelForCausalLM.from_pretrained(path, config=c, dtype=torch.float32).eval()


@pytest.mark.parametrize("spec", ["yarn:4", "linear:2.5"])
def test_engine_equals_transformers_with_the_recipe(qwen, tmp_path, spec):
    root, cfg = qwen
    kind, factor = spec.split(":")[0], float(spec.split(":")[1])
    original = cfg["max_position_embeddings"]
    engine = build_engine(checkpoint=root / "hf", output_dir=tmp_path / "e", dtype="float32", device="cpu",
                          max_seq_len=256, max_batch_size=2, rope_scaling=spec, progress=False)
    model = EngineConfig.load(engine).model
    assert model.max_position_embeddings == round(original * factor)
    (spec_,) = model.rope.values()
    assert spec_.rope_type == kind
    if kind == "yarn":  # YaRN's attention factor 0.1 ln(s) + 1 scales cos and sin
        assert spec_.attention_scaling == pytest.approx(0.1 * math.log(factor) + 1)
    report = json.loads((engine / "build_report.json").read_text())
    assert any("--rope-scaling" in w for w in report.get("warnings", []))

    recipe = {"rope_type": kind, "factor": factor}
    if kind == "yarn":
        recipe["original_max_position_embeddings"] = original
    rope = {**(cfg.get("rope_parameters") or {"rope_theta": cfg["rope_theta"]}), **recipe}
    scaled = hf_model(root / "hf", rope_parameters=rope, max_position_embeddings=round(original * factor))
    plain = hf_model(root / "hf")
    ids = prompt_ids(3, 101, cfg["vocab_size"])
    with torch.no_grad():
        ref = scaled(torch.tensor([ids])).logits[0, -1]
        unscaled = plain(torch.tensor([ids])).logits[0, -1]
    assert rel_err(unscaled, ref) > 1e-3  # the recipe changes the model: the check below can fail
    for budget in (256, 32):
        assert rel_err(last_logits(LLM(engine, max_num_batched_tokens=budget), ids), ref) <= 1e-4, (spec, budget)


@pytest.mark.parametrize("spec, match", [("yarn", "TYPE:FACTOR"), ("yarn:1", "FACTOR > 1"), ("ntk:4", "TYPE:FACTOR"),
                                         ("linear:x", "TYPE:FACTOR")])
def test_bad_specs_are_refused(qwen, tmp_path, spec, match):
    root, _ = qwen
    with pytest.raises(BuildError, match=match):
        build_engine(checkpoint=root / "hf", output_dir=tmp_path / "e", device="cpu", rope_scaling=spec)
    assert not (tmp_path / "e").exists()


def test_already_scaled_checkpoints_and_gemma_are_refused(tmp_path, capsys):
    write_tiny_hf_checkpoint(tmp_path / "scaled", "llama", rope_scaling={"rope_type": "linear", "factor": 2.0})
    rc = build_main(["--checkpoint", str(tmp_path / "scaled"), "--output", str(tmp_path / "e1"), "--device", "cpu",
                     "--rope-scaling", "yarn:4", "--quiet"])
    assert rc == 1 and "already scales RoPE" in capsys.readouterr().err
    write_tiny_hf_checkpoint(tmp_path / "gemma", "gemma3")
    rc = build_main(["--checkpoint", str(tmp_path / "gemma"), "--output", str(tmp_path / "e2"), "--device", "cpu",
                     "--rope-scaling", "yarn:4", "--quiet"])
    assert rc == 1 and "Gemma-3" in capsys.readouterr().err
    assert not (tmp_path / "e1").exists() and not (tmp_path / "e2").exists()


def test_a_legacy_config_gets_the_model_cards_recipe():
    """A config.json from before transformers 5 (rope_theta at the top, no rope_parameters) gets
    exactly what Qwen2.5's model card says to add for 128K."""
    from infhip.builder.hf_config import with_rope_scaling
    d = {"model_type": "qwen2", "max_position_embeddings": 32768, "rope_theta": 1e6}
    out, note = with_rope_scaling(d, "yarn:4")
    assert out["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert out["max_position_embeddings"] == 131072 and "32768 -> 131072" in note
    assert d == {"model_type": "qwen2", "max_position_embeddings": 32768, "rope_theta": 1e6}  # not mutated
