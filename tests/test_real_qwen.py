"""Qwen2.5-Coder (issue 21) on its real weights against transformers, CPU float32: the split GGUF
joins to the pinned file, the last-token logits of a ~200-token prompt agree and 8 greedy tokens
are equal (chunked prefill and batching are checked on tiny models: test_runtime_vs_hf.py). Each
model is skipped unless all its parts are installed (`pip install -e ".[real-qwen]"` for the 0.5B;
the 1.5B's 22 parts: `.[real-qwen-1p5b]`)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from infhip import LLM, SamplingParams
from infhip.builder import registry
from infhip.builder.build import build_engine
from tests._real import one_gguf_parse
from tests.test_runtime_vs_hf import last_logits, rel_err

pytestmark = pytest.mark.slow

PROMPT = ("def binary_search(items, target):\n"
          "    \"\"\"Return the index of target in the sorted list items, or -1.\"\"\"\n"
          "    lo, hi = 0, len(items) - 1\n"
          "    while lo <= hi:\n"
          "        mid = (lo + hi) // 2\n"
          "        if items[mid] == target:\n"
          "            return mid\n") * 3 + "\n\ndef merge_sort(items):\n"
NUM_TOKENS = 8


def _skip_unless_installed(alias: str) -> None:
    spec = registry.SPLIT_GGUFS[alias]
    _, missing = registry.split_gguf_parts(spec)
    if missing:
        pytest.skip(f"{alias}: parts {missing} not installed ({spec.pip_command()})")


@pytest.mark.parametrize("alias", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_qwen_matches_transformers(alias, tmp_path):
    _skip_unless_installed(alias)
    gguf = registry.resolve_model(alias).path
    assert gguf.stat().st_size == registry.SPLIT_GGUFS[alias].size
    engine = build_engine(model=alias, output_dir=tmp_path / alias, dtype="float32", device="cpu",
                          max_seq_len=1024, max_batch_size=2, progress=False)
    with one_gguf_parse():  # (one parse of the file for transformers' two reads of it)
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    llm = LLM(engine)
    ids = llm.tokenizer(PROMPT)["input_ids"]  # (the builder's tokenizer is transformers' GGUF one)
    assert llm.tokenizer.decode(ids) == PROMPT and 150 <= len(ids) <= 400

    # plain greedy with transformers' KV cache; its prompt pass gives the reference logits too
    ref, past, step = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(NUM_TOKENS):
            res = hf(step, past_key_values=past, use_cache=True, logits_to_keep=1)
            past = res.past_key_values
            if not ref:
                ref_logits = res.logits[0, -1]
            ref.append(int(res.logits[0, -1].argmax()))
            step = torch.tensor([[ref[-1]]])
    assert rel_err(last_logits(llm, ids), ref_logits) <= 1e-4
    out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == ref, (llm.tokenizer.decode(out.token_ids), llm.tokenizer.decode(ref))
