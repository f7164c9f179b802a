"""Qwen3-Next (``model_type: qwen3_next``) at build time: its weight table and what the family
does not support yet.

Layer kinds (transformers' modeling_qwen3_next.py): ``linear_attention`` layers hold a gated
DeltaNet (``linear_attn``), every ``full_attention_interval``-th layer a gated full attention
(``self_attn``); the feed-forward is a sparse MoE with a shared expert (``mlp``) or, for
``mlp_only_layers``, the dense gated MLP. Every Qwen3NextRMSNorm multiplies by ``1 + w`` (folded
here, as Gemma's); the DeltaNet's gated norm multiplies by ``w`` (kind ``norm_plain``).

Row orders chosen here so the runtime splits instead of gathers:

* ``self_attn.qkv_proj`` = [q | k | v | gate]: HF's q_proj interleaves per head [q_h (D), gate_h (D)].
  Within each q and k head (and q_norm / k_norm) the dims are put in ``rotary_order``: the
  runtime's rotate-half kernel pairs dim j with j + D/2 over the whole head, HF pairs j with
  j + R/2 over the first R (rotary) dims; in the new order the rotary pairs meet, the other dims
  pair among themselves with frequency 0 (builder/hf_config.py pads inv_freq with zeros), and a
  dot product q.k is unchanged by the same permutation of both.
* ``linear_attn.in_proj`` = [q | k | v | z | b | a] (heads in order) from in_proj_qkvz and
  in_proj_ba, which HF groups per key head as [q, k, v, z] and [b, a].
* ``mlp.experts.gate_up_proj`` [E * 2I, hidden] (expert e: rows e*2I.., gate then up),
  ``mlp.experts.down_proj`` [E * hidden, I]: the experts stacked, viewed [E, ...] at load.
"""

from __future__ import annotations

from infhip.config import ModelConfig
from infhip.errors import BuildError


def rotary_order(head_dim: int, rotary: int) -> list[int]:
    """Old dim of each new dim of a head (see module docstring): [0, R/2), [R, R + (D-R)/2),
    [R/2, R), [R + (D-R)/2, D)."""
    half_r, half_p = rotary // 2, (head_dim - rotary) // 2
    return (list(range(half_r)) + list(range(rotary, rotary + half_p)) + list(range(half_r, rotary))
            + list(range(rotary + half_p, head_dim)))


def _attention(m: ModelConfig) -> list[tuple]:
    h, d, hq, hkv = m.hidden_size, m.head_dim, m.num_heads, m.num_kv_heads
    order = rotary_order(d, m.rotary_dim or d)
    q = [head * 2 * d + i for head in range(hq) for i in order]  # q_proj rows: [q_h, gate_h] per head
    gate = [head * 2 * d + d + i for head in range(hq) for i in range(d)]
    k = [2 * hq * d + head * d + i for head in range(hkv) for i in order]
    v = list(range(2 * hq * d + hkv * d, 2 * hq * d + 2 * hkv * d))
    rows = q + k + v + gate
    return [
        ("self_attn.qkv_proj.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
         "matrix", (len(rows), h), tuple(rows)),
        ("self_attn.q_norm.weight", ("self_attn.q_norm.weight",), "norm", (d,), tuple(order)),
        ("self_attn.k_norm.weight", ("self_attn.k_norm.weight",), "norm", (d,), tuple(order)),
        ("self_attn.o_proj.weight", ("self_attn.o_proj.weight",), "matrix", (h, m.q_size), None),
    ]


def _linear_attention(m: ModelConfig) -> list[tuple]:
    la, h = m.linear_attention, m.hidden_size
    dk, dv, hk, r = la.key_head_dim, la.value_head_dim, la.num_key_heads, la.num_value_heads // la.num_key_heads
    group = 2 * dk + 2 * r * dv  # in_proj_qkvz rows of one key head: q, k, v (r heads), z (r heads)
    q = [g * group + i for g in range(hk) for i in range(dk)]
    k = [g * group + dk + i for g in range(hk) for i in range(dk)]
    v = [g * group + 2 * dk + i for g in range(hk) for i in range(r * dv)]
    z = [g * group + 2 * dk + r * dv + i for g in range(hk) for i in range(r * dv)]
    ba0 = hk * group  # in_proj_ba rows of one key head: b (r), a (r)
    b = [ba0 + g * 2 * r + i for g in range(hk) for i in range(r)]
    a = [ba0 + g * 2 * r + r + i for g in range(hk) for i in range(r)]
    rows = q + k + v + z + b + a
    p = "linear_attn."
    return [
        (p + "in_proj.weight", (p + "in_proj_qkvz.weight", p + "in_proj_ba.weight"), "matrix", (len(rows), h), tuple(rows)),
        (p + "conv1d.weight", (p + "conv1d.weight",), "matrix", (la.conv_dim, 1, la.conv_kernel), None),
        (p + "dt_bias", (p + "dt_bias",), "float32", (la.num_value_heads,), None),
        (p + "A_log", (p + "A_log",), "float32", (la.num_value_heads,), None),
        (p + "norm.weight", (p + "norm.weight",), "norm_plain", (dv,), None),
        (p + "out_proj.weight", (p + "out_proj.weight",), "matrix", (h, la.value_dim), None),
    ]


def _feed_forward(m: ModelConfig, layer: int) -> list[tuple]:
    h = m.hidden_size
    moe = m.moe
    if moe is None or layer not in moe.layers:
        i = m.intermediate_size
        return [("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "matrix", (2 * i, h), None),
                ("mlp.down_proj.weight", ("mlp.down_proj.weight",), "matrix", (h, i), None)]
    e, i, s = moe.num_experts, moe.intermediate_size, moe.shared_intermediate_size
    gate_up = tuple(f"mlp.experts.{x}.{w}_proj.weight" for x in range(e) for w in ("gate", "up"))
    down = tuple(f"mlp.experts.{x}.down_proj.weight" for x in range(e))
    return [
        ("mlp.gate.weight", ("mlp.gate.weight",), "matrix", (e, h), None),
        ("mlp.experts.gate_up_proj.weight", gate_up, "matrix", (e * 2 * i, h), None),
        ("mlp.experts.down_proj.weight", down, "matrix", (e * h, i), None),
        ("mlp.shared_expert.gate_up_proj.weight", ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
         "matrix", (2 * s, h), None),
        ("mlp.shared_expert.down_proj.weight", ("mlp.shared_expert.down_proj.weight",), "matrix", (h, s), None),
        ("mlp.shared_expert_gate.weight", ("mlp.shared_expert_gate.weight",), "matrix", (1, h), None),
    ]


def layer_table(m: ModelConfig, layer: int) -> list[tuple]:
    """(our suffix, HF suffixes, kind, shape, row order or None) of decoder layer ``layer``."""
    h = m.hidden_size
    mixer = _linear_attention(m) if m.layer_types[layer] == "linear_attention" else _attention(m)
    return ([("input_layernorm.weight", ("input_layernorm.weight",), "norm", (h,), None)] + mixer
            + [("post_attention_layernorm.weight", ("post_attention_layernorm.weight",), "norm", (h,), None)]
            + _feed_forward(m, layer))


def build_problem(m: ModelConfig, preset: str, methods, weight_dtype: str, tp: int) -> str | None:
    """Why this family cannot be built so yet (one line naming the way that works), or None.
    methods: the plan's method names (knobs)."""
    if m.architecture != "qwen3_next":
        return None
    others = sorted(set(methods) - {"token_drop"})
    unsupported = [(preset != "dense", f"--preset {preset}", "--preset dense"),
                   (bool(others), "plan methods " + ", ".join(others), "--preset dense, with or without --token-drop"),
                   (weight_dtype != "bf16", f"--weight-dtype {weight_dtype}", "--weight-dtype bf16"),
                   (tp != 1, f"--tp {tp}", "--tp 1")]
    for bad, what, fix in unsupported:
        if bad:
            return f"qwen3_next (Qwen3-Next) engines do not support {what} yet; build with {fix}"
    return None


def check_build(m: ModelConfig, preset: str, plan, weight_dtype: str, tp: int) -> None:
    """BuildError with build_problem's line, if any."""
    problem = build_problem(m, preset, plan.knobs, weight_dtype, tp)
    if problem is not None:
        raise BuildError(problem)
