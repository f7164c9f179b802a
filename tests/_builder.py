"""Helpers of the infhip-build tests (test_builder*.py): tiny checkpoints, an in-process build
and CLI, and the one-line-error check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from infhip.builder import build_engine
from infhip.builder.cli import main as cli_main
from tests._tiny import ARCHS, write_tiny_hf_checkpoint


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
