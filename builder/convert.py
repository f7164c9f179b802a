"""HF-named checkpoint tensors -> infhip weights (names and layout of infhip/config.py's docstring).

Driven by one declarative table per layer: each of our weights lists the HF tensors it is made of
and how (``copy``, ``cat`` along rows, ``norm``). Fusions: q/k/v -> ``qkv_proj`` (rows q, k, v;
biases alike) and gate/up -> ``gate_up_proj`` (gate rows first), so the runtime runs one GEMM
where HF runs three (two). Norm weights are stored float32 with Gemma's ``1 + w`` folded in (the
runtime's RMSNorm multiplies by the stored weight, for every architecture); everything else is
cast to the build dtype — except, in an fp8 engine, the weights of the linear layers named by
``EngineConfig.fp8_linears()``: those are quantized from the checkpoint's own precision to
float8_e4m3fn with a float32 ``<name>.weight_scale`` per output channel (plugins/fp8_linear.py),
and a tied LM head that is quantized gets an fp8 ``lm_head.weight`` of its own.

    >>> from infhip.builder.hf_config import model_config_from_hf
    >>> import json; from infhip.builder.registry import bundled_config
    >>> model, _ = model_config_from_hf(json.loads(bundled_config("qwen2.5-7b").read_text()))
    >>> [s.name for s in weight_specs(model)][:4]
    ['embed_tokens.weight', 'layers.0.input_layernorm.weight', 'layers.0.self_attn.qkv_proj.weight', 'layers.0.self_attn.qkv_proj.bias']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from infhip.config import ModelConfig
from infhip.builder import qwen3_next
from infhip.builder.checkpoint import Checkpoint
from infhip.errors import BuildError
from infhip.plugins.dtypes import DTYPES

# Checkpoint tensors that the text decoder does not need (buffers, other modalities).
IGNORABLE_PREFIXES = ("vision_tower.", "multi_modal_projector.", "vision_model.", "audio_tower.")
IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class WeightSpec:
    name: str  # our name
    sources: tuple[str, ...]  # HF names (prefix-stripped), concatenated along dim 0 in this order
    kind: str  # "matrix" (build dtype) | "norm" (float32, offset folded) | "norm_plain" / "float32" (float32 as is)
    shape: tuple[int, ...]
    rows: tuple[int, ...] | None = None  # row order after the concatenation (builder/qwen3_next.py), None: as is


def _layer_table(m: ModelConfig) -> list[tuple[str, tuple[str, ...], str, tuple[int, ...]]]:
    """(our suffix, HF suffixes, kind, shape) of one decoder layer; the name map itself."""
    qkv_rows = m.q_size + 2 * m.kv_size
    h, i, d = m.hidden_size, m.intermediate_size, m.head_dim
    gemma = m.architecture == "gemma3"
    table = [
        ("input_layernorm.weight", ("input_layernorm.weight",), "norm", (h,)),
        ("self_attn.qkv_proj.weight",
         ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "matrix", (qkv_rows, h)),
    ]
    if m.attention_bias:
        table.append(("self_attn.qkv_proj.bias",
                      ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), "matrix", (qkv_rows,)))
    if m.qk_norm:
        table += [("self_attn.q_norm.weight", ("self_attn.q_norm.weight",), "norm", (d,)),
                  ("self_attn.k_norm.weight", ("self_attn.k_norm.weight",), "norm", (d,))]
    table += [
        ("self_attn.o_proj.weight", ("self_attn.o_proj.weight",), "matrix", (h, m.q_size)),
        ("post_attention_layernorm.weight", ("post_attention_layernorm.weight",), "norm", (h,)),
    ]
    if gemma:
        table += [("pre_feedforward_layernorm.weight", ("pre_feedforward_layernorm.weight",), "norm", (h,)),
                  ("post_feedforward_layernorm.weight", ("post_feedforward_layernorm.weight",), "norm", (h,))]
    table += [
        ("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "matrix", (2 * i, h)),
        ("mlp.down_proj.weight", ("mlp.down_proj.weight",), "matrix", (h, i)),
    ]
    return table


def weight_specs(m: ModelConfig) -> list[WeightSpec]:
    """Every weight of the engine (rope inv_freq aside), in file order."""
    specs = [WeightSpec("embed_tokens.weight", ("embed_tokens.weight",), "matrix", (m.vocab_size, m.hidden_size))]
    for layer in range(m.num_layers):
        p = f"layers.{layer}."
        if m.architecture == "qwen3_next":
            specs += [WeightSpec(p + ours, tuple(p + s for s in srcs), kind, shape, rows)
                      for ours, srcs, kind, shape, rows in qwen3_next.layer_table(m, layer)]
            continue
        specs += [WeightSpec(p + ours, tuple(p + s for s in srcs), kind, shape)
                  for ours, srcs, kind, shape in _layer_table(m)]
    specs.append(WeightSpec("norm.weight", ("norm.weight",), "norm", (m.hidden_size,)))
    if not m.tie_word_embeddings:
        specs.append(WeightSpec("lm_head.weight", ("lm_head.weight",), "matrix", (m.vocab_size, m.hidden_size)))
    return specs


def norm_offset(m: ModelConfig) -> float:
    """Gemma's and Qwen3-Next's RMSNorm multiply by (1 + w): fold the 1 so every norm is plain
    ``x_hat * w`` (kind "norm"; Qwen3-Next's gated norm multiplies by w: kind "norm_plain")."""
    return 1.0 if m.architecture in ("gemma3", "qwen3_next") else 0.0


def unused_tensors(ckpt: Checkpoint, specs: list[WeightSpec]) -> list[str]:
    """Checkpoint tensors no spec reads, excluding the known-harmless ones."""
    used = {s for spec in specs for s in spec.sources}
    return [n for n in ckpt.names() if n not in used and not n.startswith(IGNORABLE_PREFIXES)
            and not n.endswith(IGNORABLE_SUFFIXES)]


def check_complete(ckpt: Checkpoint, specs: list[WeightSpec]) -> None:
    have = set(ckpt.names())
    missing = [s for spec in specs for s in spec.sources if s not in have]
    if missing:
        shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise BuildError(f"{ckpt.description} lacks tensors its config requires: {shown}; "
                         "the checkpoint is incomplete or does not match its config.json")


def _matrix(name: str, t: torch.Tensor, target: torch.dtype, fp8: frozenset[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """One matrix or bias in the build dtype, or an fp8 linear weight and its scales."""
    module = name.removesuffix(".weight")
    if module != name and module in fp8:
        from infhip.plugins.fp8_linear import quantize_weight
        q, scale = quantize_weight(t)
        yield name, q.cpu()
        yield module + ".weight_scale", scale.cpu()
    else:
        yield name, t.to(target).cpu().contiguous()


def _tied_head(m: ModelConfig, name: str, fp8: frozenset[str]) -> bool:
    """Is ``name`` the embedding that a quantized tied LM head is made from?"""
    return name == "embed_tokens.weight" and m.tie_word_embeddings and "lm_head" in fp8


def convert_weights(ckpt: Checkpoint, m: ModelConfig, dtype: str,
                    wrap: Callable[[list], list] = lambda x: x,
                    fp8: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (our name, CPU tensor) one at a time; ``wrap`` may add a progress bar over the specs;
    ``fp8``: module paths whose weights are quantized (EngineConfig.fp8_linears())."""
    specs = weight_specs(m)
    check_complete(ckpt, specs)
    target, offset = DTYPES[dtype], norm_offset(m)
    for spec in wrap(specs):
        parts = [ckpt.get(s) for s in spec.sources]
        for src, t in zip(spec.sources, parts):
            if t.dim() != len(spec.shape) or (len(spec.sources) == 1 and tuple(t.shape) != spec.shape):
                raise BuildError(f"{ckpt.description}: {src} has shape {tuple(t.shape)}, config implies "
                                 f"{spec.shape}; the checkpoint does not match its config.json")
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if tuple(t.shape) != spec.shape:
            raise BuildError(f"{ckpt.description}: {' + '.join(spec.sources)} give shape {tuple(t.shape)}, "
                             f"config implies {spec.shape}; the checkpoint does not match its config.json")
        if spec.rows is not None:
            t = t[torch.tensor(spec.rows)]
        if spec.kind != "matrix":
            yield spec.name, (t.to(torch.float32) + (offset if spec.kind == "norm" else 0.0)).contiguous()
            continue
        yield from _matrix(spec.name, t, target, fp8)
        if _tied_head(m, spec.name, fp8):
            yield from _matrix("lm_head.weight", t, target, fp8)


def random_weights(m: ModelConfig, dtype: str, device: str = "cpu", seed: int = 0,
                   wrap: Callable[[list], list] = lambda x: x,
                   fp8: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Same names and shapes as ``convert_weights`` without a checkpoint: matrices and biases
    ~ N(0, 0.02) generated directly in the build dtype on ``device`` (cuda makes an 8B bf16 engine
    quick; fp8 weights are quantized there too), norms 1.0 (i.e. already folded: Gemma's 1 + 0).
    Deterministic for a seed and device; an fp8 engine's weights are the bf16 engine's, quantized."""
    target = DTYPES[dtype]
    gen = torch.Generator(device=device).manual_seed(seed)
    for spec in wrap(weight_specs(m)):
        if spec.kind != "matrix":
            yield spec.name, torch.ones(spec.shape, dtype=torch.float32)
            continue
        t = torch.empty(spec.shape, dtype=target, device=device).normal_(0.0, 0.02, generator=gen)
        yield from _matrix(spec.name, t, target, fp8)
        if _tied_head(m, spec.name, fp8):
            yield from _matrix("lm_head.weight", t, target, fp8)
