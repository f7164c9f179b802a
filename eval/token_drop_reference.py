"""Plain-torch reference of token dropping (UniPrefill; the tests' and benchmarks/quality/'s float64
check of the engine; not used by the engine): the whole sequence (prompt + generated
tokens) in one causal pass, with no paging, no compaction, no kernels, dropping expressed as
masks only. It reads the engine's weights (the runtime modules' tensors) and the kept prompt
positions each drop layer chose, and applies the semantics of infhip/methods/token_drop/runtime/step.py under a
schedule (TokenDropConfig's drop_layers / drop_point / reenter):

* drop layers: the layers in ``schedule["layers"]`` (default: every full-attention layer);
* with ``reenter``, at a drop layer every row re-enters (dropped rows carry the stream they had
  when dropped) and the layer chooses its kept set from all of them; without it the layer
  chooses among the rows still active (blocks of G over those rows in order);
* ``point`` "before": from the drop layer on (its own attention included), active rows = its
  kept prompt positions plus every generated token; "after": the drop layer's attention runs
  over (and writes K/V of) the rows active before it, its MLP and later layers over the kept;
* a layer updates active rows only, and its keys are the rows that ran its attention (a
  dropped token wrote no KV there); sliding layers see keys in (p - W, p], global layers all <= p.

Logits at row t equal what an engine decoding token t + 1 should compute.

With `select`, the reference also *chooses* the kept sets itself (`reference_select`, the spec's
top-p over block importance, from its own stream) instead of reading the engine's, so it checks
the engine's selection end to end, and it can spare chosen drop layers. Selection assumes the
whole prompt is one prefill pass (one scheduler chunk).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, inv_freq, scaling):
    angle = pos.double()[:, None] * inv_freq.double()[None, :]
    cos = torch.cat([angle.cos(), angle.cos()], -1)[:, None, :] * scaling
    sin = torch.cat([angle.sin(), angle.sin()], -1)[:, None, :] * scaling
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


@torch.no_grad()
def reference_select(q: torch.Tensor, k: torch.Tensor, num_prompt: int, scale: float, *, p: float,
                     n: int, G: int, A: int, tail: int) -> torch.Tensor:
    """Kept prompt positions (ascending) of one anchor whose prompt is one prefill pass, by the
    spec: q [L, Hq, D], k [L, Hkv, D] after RoPE; the last n prompt queries score the prompt keys
    (softmax over each row's causal keys), mean over rows, sum over heads, mean within blocks of
    G; the fewest blocks by descending score (ties: lower index first) holding fraction p of the
    total, plus positions < A and the last `tail` prompt positions. p >= 1 keeps everything."""
    L = num_prompt
    if p >= 1:
        return torch.arange(L, device=q.device)
    group = q.shape[1] // k.shape[1]
    n = min(n, L)
    qw = q[L - n:L].double()
    kk = k[:L].double().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", qw, kk) * scale
    qpos, kpos = torch.arange(L - n, L, device=q.device), torch.arange(L, device=q.device)
    prob = torch.softmax(s.masked_fill(~(kpos[None, :] <= qpos[:, None])[None], -math.inf), -1)
    o = prob.mean(1).sum(0)  # [L] per key
    nb = -(-L // G)
    block = kpos // G
    score = torch.zeros(nb, dtype=o.dtype, device=o.device).index_add_(0, block, o)
    score /= torch.bincount(block, minlength=nb).to(o.dtype)
    order = torch.sort(score, descending=True, stable=True).indices
    k_star = min(nb, 1 + int((torch.cumsum(score[order], 0) < p * score.sum()).sum()))
    block_keep = torch.zeros(nb, dtype=torch.bool, device=q.device)
    block_keep[order[:k_star]] = True
    keep = block_keep[block] | (kpos < A) | (kpos >= L - tail)
    return torch.nonzero(keep).flatten()


@torch.no_grad()
def reference_logits(model, ids: list[int], num_prompt: int, kept: dict[int, torch.Tensor],
                     plan_layers, select: dict | None = None, schedule: dict | None = None) -> torch.Tensor:
    """float64 logits [len(ids), vocab]. kept: drop layer -> kept prompt positions (a drop layer
    not in kept keeps every row; entries of other layers are ignored); plan_layers: the engine
    plan's LayerPlan tuple.

    select: dict(p, n, G, A, tail[, spare]) -> every drop layer not in `spare` chooses its kept
    set with `reference_select` from the stream it receives (the engine's semantics for a
    one-chunk prompt), written into `kept` (which the caller passes empty and reads afterwards).
    schedule: dict(layers=iterable of drop layers (default every full-attention layer),
    point="before" | "after" (default "before"), reenter=bool (default True)): the default is the
    schedule of engines built before these knobs."""
    cfg = model.cfg
    gemma = cfg.architecture == "gemma3"
    L = len(ids)
    dev = model.embed_tokens.weight.device
    pos = torch.arange(L, device=dev)
    x = model.embed(torch.tensor(ids, device=dev)).double()
    chosen, kept = kept, {layer: p.to(dev) for layer, p in kept.items()}  # chosen: the caller's dict
    schedule = dict(schedule or {})
    drop_layers = set(schedule.get("layers", [lp.index for lp in plan_layers if lp.window is None]))
    after, reenter = schedule.get("point", "before") == "after", schedule.get("reenter", True)
    active = torch.ones(L, dtype=torch.bool, device=dev)
    for l, layer in enumerate(model.layers):
        lp, attn = plan_layers[l], layer.self_attn
        h = _rms(x, layer.input_layernorm.weight.double(), cfg.rms_norm_eps)
        qkv = F.linear(h, attn.qkv_proj.weight.double(),
                       None if attn.qkv_proj.bias is None else attn.qkv_proj.bias.double())
        qs, kvs = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q = qkv[:, :qs].view(L, cfg.num_heads, cfg.head_dim)
        k = qkv[:, qs:qs + kvs].view(L, cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, qs + kvs:].view(L, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = _rms(q, attn.q_norm.weight.double(), cfg.rms_norm_eps)
            k = _rms(k, attn.k_norm.weight.double(), cfg.rms_norm_eps)
        rope = attn.rope[0]
        q, k = _rope(q, pos, rope.inv_freq, rope.attention_scaling), _rope(k, pos, rope.inv_freq, rope.attention_scaling)
        keys = active.clone()  # a token writes KV at a layer exactly when it runs its attention
        if lp.window is None and l in drop_layers:
            if reenter:  # reconstitution: every row re-enters
                active = torch.ones(L, dtype=torch.bool, device=dev)
                keys = active.clone()
            if select is not None and l not in select.get("spare", ()):  # chosen from this stream (active rows)
                rows = torch.nonzero(active[:num_prompt]).flatten()
                kept[l] = chosen[l] = rows[reference_select(q[rows], k[rows], len(rows), attn.scale, p=select["p"],
                                                            n=select["n"], G=select["G"], A=select["A"],
                                                            tail=select["tail"])]
            if l in kept:  # this layer's drop: only its kept tokens (and generated ones) from here on
                active = torch.zeros(L, dtype=torch.bool, device=dev)
                active[kept[l]] = True
                active[num_prompt:] = True
                if not after:
                    keys = active.clone()
        group = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        visible = (pos[None, :] <= pos[:, None]) & keys[None, :]
        if lp.window is not None:
            visible &= pos[None, :] > pos[:, None] - lp.window
        s = torch.einsum("qhd,khd->hqk", q, k) * attn.scale
        p = torch.softmax(s.masked_fill(~visible[None], -math.inf), -1)
        o = torch.einsum("hqk,khd->qhd", p, v).reshape(L, -1)
        a = F.linear(o, attn.o_proj.weight.double())
        mlp = layer.mlp
        if gemma:
            x1 = x + _rms(a, layer.post_attention_layernorm.weight.double(), cfg.rms_norm_eps)
            h2 = _rms(x1, layer.pre_feedforward_layernorm.weight.double(), cfg.rms_norm_eps)
        else:
            x1 = x + a
            h2 = _rms(x1, layer.post_attention_layernorm.weight.double(), cfg.rms_norm_eps)
        gate, up = F.linear(h2, mlp.gate_up_proj.weight.double()).chunk(2, -1)
        act = F.gelu(gate, approximate="tanh") if cfg.hidden_act == "gelu_tanh" else F.silu(gate)
        m = F.linear(act * up, mlp.down_proj.weight.double())
        if gemma:
            m = _rms(m, layer.post_feedforward_layernorm.weight.double(), cfg.rms_norm_eps)
        x = torch.where(active[:, None], x1 + m, torch.where(keys[:, None], x1, x))
    h = _rms(x, model.norm.weight.double(), cfg.rms_norm_eps)
    weight = model.embed_tokens.weight if cfg.tie_word_embeddings else model.lm_head.weight
    logits = F.linear(h, weight.double())
    if cfg.final_logit_softcapping:
        logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    return logits


def token_drop_view(llm) -> dict:
    """Token drop's read-out of a loaded engine (TokenDrop.debug_view: knobs, drop_layers, tail,
    max_context, retention per sequence and anchor)."""
    return llm.debug_view()["transforms"]["token_drop"]


def reference_schedule(llm) -> dict:
    """The reference's schedule of a loaded engine's token drop (drop layers with the spared ones):
    what reference_logits(schedule=...) needs to drop as the engine does."""
    from infhip.methods.token_drop import TokenDropConfig, resolve_drop_layers
    cfg = TokenDropConfig(**token_drop_view(llm)["knobs"])
    plan = llm.engine.config.plan.layers
    layers = resolve_drop_layers(dataclasses.replace(cfg, spare_anchors=0),
                                 [lp.index for lp in plan if lp.window is None and lp.attention != "linear"],
                                 len(plan))
    return dict(layers=layers, point=cfg.drop_point.split("_")[0], reenter=cfg.reenter)


def run_greedy(llm, ids: list[int], steps: int) -> tuple[list[int], torch.Tensor, int]:
    """Prefill + `steps` greedy decodes through scheduler and runner; (tokens, logits [steps, V],
    seq_id) where logits[j] produced tokens[j] (benchmarks/quality/token_drop_ablation.py uses it too)."""
    from infhip import SamplingParams
    from infhip.runtime.sequence import Sequence
    seq = Sequence(seq_id=10_000 + len(token_drop_view(llm)["retention"]), prompt_token_ids=list(ids),
                   params=SamplingParams(max_tokens=steps, ignore_eos=True))
    llm.scheduler.add(seq)
    tokens, logits = [], []
    while len(tokens) < steps:
        out = llm.scheduler.schedule()
        step_logits = llm.runner.execute(out)
        if out.chunks[0].needs_logits:
            logits.append(step_logits[0])
            tokens.append(int(step_logits[0].argmax()))
            llm.scheduler.update(out, {seq.seq_id: tokens[-1]})
        else:
            llm.scheduler.update(out, {})
    llm.scheduler.finish(seq, "abort")
    return tokens, torch.stack(logits), seq.seq_id
