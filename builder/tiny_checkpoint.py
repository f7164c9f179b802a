"""Tiny random Hugging Face checkpoints of every supported architecture, written with transformers:
the builder's smallest inputs, for the tests (tests/_tiny.py builds engines from them) and the GPU
smoke call (benchmarks/gpu/smoke.py).

Odd sizes on purpose (hidden 48, 6 query heads over 2 KV heads, head_dim 16, intermediate 80,
vocab 300), float32, a fixed seed, and every parameter randomised, norm weights included, so that
fusions, GQA and Gemma's ``1 + w`` folding are all visible in comparisons. Gemma-3 gets 7 layers
(5 sliding with window 16, a global one, a sliding one) and Llama a llama3-scaled RoPE.

    >>> from infhip.builder.tiny_checkpoint import write_tiny_hf_checkpoint
    >>> cfg = write_tiny_hf_checkpoint(tmp_path / "hf", "gemma3")   # doctest: +SKIP
    >>> cfg["layer_types"][5]                                        # doctest: +SKIP
    'full_attention'
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3")

_COMMON = dict(
    hidden_size=48, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
    intermediate_size=80, vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
)

# arch -> (config class, model class, arch-specific config values)
_ARCH = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, rope_theta=1000000.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, use_sliding_window=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(use_sliding_window=False)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=7, sliding_window=16, sliding_window_pattern=6, query_pre_attn_scalar=24,
        tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh", eos_token_id=[2, 3],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # not in ARCHS (the tests over every Llama-style family): tests/test_qwen3_next.py. Hidden 64,
    # the real 3:1 linear/full pattern, 6 experts top-2 and a shared expert (layer 1 dense MLP),
    # partial RoPE over 4 of 16 dims, 4 value heads over 2 key heads.
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, mlp_only_layers=[1])),
}
# Families whose RMSNorm multiplies by 1 + w (w random around 0); their other norms (Qwen3-Next's
# gated norm, ``linear_attn.norm``) multiply by w.
_OFFSET_NORMS = {"gemma3": lambda name: True, "qwen3_next": lambda name: "linear_attn.norm" not in name}


@torch.no_grad()
def _randomise(model: torch.nn.Module, arch: str, seed: int) -> None:
    """Fresh values for every parameter: matrices N(0, 0.08), biases N(0, 0.05), norms around
    their neutral value (Gemma stores w with scale 1 + w, so w ~ N(0, 0.1))."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if "norm" in name:
            neutral = 0.0 if _OFFSET_NORMS.get(arch, lambda name: False)(name) else 1.0
            p.copy_(neutral + 0.1 * noise)
        elif name.endswith(".bias"):
            p.copy_(0.05 * noise)
        else:
            p.copy_(0.08 * noise)


_CORPUS = ("In the beginning God created the heaven and the earth. And the earth was without form, "
           "and void; and darkness was upon the face of the deep. And God said, Let there be light: "
           "and there was light. 0123456789 The quick brown fox jumps over the lazy dog.\n")
_CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                  "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def write_tiny_tokenizer(path: str | Path, vocab_size: int = 300) -> None:
    """A byte-level BPE trained on a few sentences: ids 0/1/2 = <pad>/<s>/</s> (the tiny configs'
    pad/bos/eos), every byte encodable, ~40 merges, a chat template; saved with save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def write_tiny_hf_checkpoint(path: str | Path, arch: str, seed: int = 0, tokenizer: bool = False,
                             **overrides: Any) -> dict[str, Any]:
    """Write a tiny random ``arch`` model (config.json + model.safetensors, and with ``tokenizer``
    a tiny byte-level BPE tokenizer) into ``path``; return the HF config dict as saved.
    ``overrides`` replace config values (e.g. ``num_hidden_layers=2``)."""
    import transformers

    if arch not in _ARCH:
        raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")
    config_cls, model_cls, extra = _ARCH[arch]
    kwargs = {**_COMMON, **extra, **overrides}
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    _randomise(model, arch, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    if tokenizer:
        write_tiny_tokenizer(path, vocab_size=config.vocab_size)
    return json.loads((path / "config.json").read_text())
