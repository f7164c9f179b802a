"""infhip-build never destroys what it reads or what is not an engine: an --output that is, holds
or lies inside the checkpoint is refused with a one-line error and nothing written; --force
replaces infhip engines only (with or without the "format" marker of infhip/config.py); and the
temporary folders that killed builds leave are removed by the next build of the same output,
while a running build's is left alone (issue 19)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infhip.builder.build import build_engine
from infhip.builder.cli import main as cli_main
from infhip.config import ENGINE_FORMAT, EngineConfig, is_engine_dir
from tests._tiny import write_tiny_hf_checkpoint


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint with an unrelated file next to its weights."""
    path = tmp_path_factory.mktemp("ckpt") / "hf"
    write_tiny_hf_checkpoint(path, "llama")
    (path / "notes.txt").write_text("not ours")
    return path


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root (symlinks as their target): relative path -> content digest."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def build_cli(capsys, *argv) -> tuple[int, str]:
    rc = cli_main([*map(str, argv), "--device", "cpu", "--dtype", "float32", "--quiet"])
    return rc, capsys.readouterr().err


def assert_one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 1 and err.startswith("infhip-build: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("output, message", [
    ("{hf}", "is the checkpoint"),
    ("{root}", "contains the checkpoint"),
    ("{hf}/engine", "lies inside the checkpoint"),
    ("{root}/link", "is the checkpoint"),  # a symlink to it
])
def test_output_at_the_checkpoint_is_refused_and_nothing_is_written(hf, tmp_path, capsys, output, message):
    root = hf.parent
    link = root / "link"
    if not link.exists():
        link.symlink_to(hf, target_is_directory=True)
    before = snapshot(root)
    out = output.format(hf=hf, root=root)
    rc, err = build_cli(capsys, "--checkpoint", hf, "--output", out, "--force")
    assert_one_line_error(rc, err, message, "choose an --output outside it")
    assert snapshot(root) == before


def test_config_file_checkpoint_is_protected_too(hf, capsys):
    """--random-weights from a bare config.json: its folder holds the checkpoint."""
    before = snapshot(hf.parent)
    rc, err = build_cli(capsys, "--checkpoint", hf / "config.json", "--random-weights", "--output", hf, "--force")
    assert_one_line_error(rc, err, "contains the checkpoint")
    assert snapshot(hf.parent) == before


def test_force_replaces_engines_only(hf, tmp_path, capsys):
    out = build_engine(checkpoint=hf, output_dir=tmp_path / "eng", dtype="float32", device="cpu", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["format"] == ENGINE_FORMAT and is_engine_dir(out)
    # An engine from before the marker is still an engine: it loads and --force replaces it.
    del config["format"]
    (out / "config.json").write_text(json.dumps(config))
    assert is_engine_dir(out) and EngineConfig.load(out).build.dtype == "float32"
    rc, err = build_cli(capsys, "--checkpoint", hf, "--output", out, "--force")
    assert rc == 0, err
    assert json.loads((out / "config.json").read_text())["format"] == ENGINE_FORMAT
    # Folders whose config.json is not an engine's: a copy of a checkpoint, another tool's format.
    for name, cfg in (("hf-copy", (hf / "config.json").read_text()), ("other", '{"format": "other"}'),
                      ("broken", "{not json"), ("list", "[1, 2]")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(cfg)
        (folder / "model.safetensors").write_bytes(b"weights")
        assert not is_engine_dir(folder)
        rc, err = build_cli(capsys, "--checkpoint", hf, "--output", folder, "--force")
        assert_one_line_error(rc, err, "not an infhip engine", "choose another --output")
        assert (folder / "model.safetensors").read_bytes() == b"weights"


_KILLED_BUILD = """
import os, signal, sys
from infhip.builder import build
build._finish_report = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # weights written, then killed
build.build_engine(checkpoint=sys.argv[1], output_dir=sys.argv[2], dtype="float32", device="cpu", progress=False)
"""


def test_leftovers_of_killed_builds_are_removed_by_the_next_build(hf, tmp_path, capsys):
    out = tmp_path / "eng"
    killed = subprocess.run([sys.executable, "-c", _KILLED_BUILD, str(hf), str(out)], capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    [left] = [p for p in tmp_path.iterdir() if p.name.startswith(".eng.tmp-")]
    assert (left / "rank0.safetensors").is_file() and not out.exists()
    old_style = tmp_path / ".eng.tmp-old"  # no lock file (builds before it had one), an hour old
    old_style.mkdir()
    os.utime(old_style, (time.time() - 3600,) * 2)
    fresh = tmp_path / ".eng.tmp-fresh"  # no lock file yet: could be a build that just started
    fresh.mkdir()
    running = tmp_path / ".eng.tmp-running"  # a build in progress holds its lock
    running.mkdir()
    fd = os.open(running / ".infhip-build.lock", os.O_CREAT | os.O_WRONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    other = tmp_path / ".engine2.tmp-x"  # another output's
    other.mkdir()
    os.utime(other, (time.time() - 3600,) * 2)
    try:
        rc, err = build_cli(capsys, "--checkpoint", hf, "--output", out)
    finally:
        os.close(fd)
    assert rc == 0, err
    [line] = [x for x in err.splitlines() if "removed" in x]
    assert f"removed 2 unfinished folder(s) left by killed builds of {out}" in line
    assert not left.exists() and not old_style.exists()
    assert fresh.exists() and running.exists() and other.exists()
    assert EngineConfig.load(out) and not (out / ".infhip-build.lock").exists()
