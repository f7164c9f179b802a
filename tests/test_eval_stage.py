"""Engine and file staging for the GPU machine: split into <= 60 MiB parts with SHA-256 manifest, status,
join back byte for byte; a missing or corrupted part is refused with a clear error."""

from __future__ import annotations

import json
import os

import pytest

from infhip.eval.stage import (MANIFEST, StageError, join_engine, join_file, main, split_engine, split_file,
                               stage_status)


@pytest.fixture
def engine(tmp_path):
    e = tmp_path / "engines" / "fake-engine"
    (e / "tokenizer").mkdir(parents=True)
    (e / "config.json").write_text('{"format_version": 1}')
    (e / "tokenizer" / "tokenizer.json").write_text("{}")
    (e / "rank0.safetensors").write_bytes(os.urandom(2_500_000))
    return e


def test_split_join_roundtrip(engine, tmp_path):
    stage = split_engine(engine, tmp_path / ".stage", part_mib=1)
    manifest = json.loads((stage / MANIFEST).read_text())
    assert [p["bytes"] for p in manifest["parts"]] == [1 << 20, 1 << 20, 2_500_000 - (2 << 20)]
    assert not (stage / "engine" / "rank0.safetensors").exists()
    out = join_engine(stage, tmp_path / "joined")
    assert (out / "rank0.safetensors").read_bytes() == (engine / "rank0.safetensors").read_bytes()
    assert (out / "tokenizer" / "tokenizer.json").read_text() == "{}"
    assert main(["status", str(stage)]) == 0


def test_missing_or_corrupt_part_is_refused(engine, tmp_path, capsys):
    stage = split_engine(engine, tmp_path / ".stage", part_mib=1)
    part = stage / "parts" / "rank0.safetensors.001"
    data = bytearray(part.read_bytes())
    data[7] ^= 1
    part.write_bytes(bytes(data))
    assert stage_status(stage)[1] == ["parts/rank0.safetensors.001"]
    with pytest.raises(StageError, match="missing or corrupt"):
        join_engine(stage, tmp_path / "joined")
    part.unlink()
    assert main(["join", str(stage), str(tmp_path / "joined")]) == 2
    assert "rank0.safetensors.001" in capsys.readouterr().err
    assert not (tmp_path / "joined").exists()
    with pytest.raises(StageError, match="at most|must be in"):
        split_engine(engine, tmp_path / ".stage", part_mib=64)


def test_single_file_roundtrip_and_refusal(tmp_path):
    """A GGUF goes the same way as an engine's weights: split-file / join-file, byte for byte, and
    a damaged part leaves nothing at the output."""
    src = tmp_path / "model.gguf"
    src.write_bytes(os.urandom(2_200_000))
    stage = split_file(src, "m", tmp_path / ".stage", part_mib=1)
    assert sorted(p.name for p in (stage / "parts").iterdir()) == ["model.gguf.000", "model.gguf.001", "model.gguf.002"]
    assert main(["join-file", str(stage), str(tmp_path / "out" / "model.gguf")]) == 0
    assert (tmp_path / "out" / "model.gguf").read_bytes() == src.read_bytes()
    part = stage / "parts" / "model.gguf.002"
    part.write_bytes(part.read_bytes()[:-1])
    with pytest.raises(StageError, match="model.gguf.002"):
        join_file(stage, tmp_path / "again.gguf")
    assert not (tmp_path / "again.gguf").exists() and not list(tmp_path.glob(".again*"))
