"""The sampler's per-step device work (runtime/sampler.py) in four small kernels, so that a
decode step with sampling features costs a launch or two per feature group instead of a dozen
or more eager [B, V] ops.

  stages   logits [B, V] float32 -> a new [B, V] float32 with stages 1-5 of runtime/sampler.py
           applied in one pass (one program per row x vocab tile):
             1. token bitmask [B, W] int32 (W = ceil(V / 32); bit t % 32 of word t // 32 set =
                token t allowed) -> -inf where clear;
             2-4. per-row sparse entries (CSR: ent_ptr [B + 1], ent_tok / ent_need [E] int32,
                ent_val [E] float32): x[row, tok] += val while out_len[row] < need (bad words
                and min_tokens are val -inf, a bias is its value with need = NEVER_DONE; -inf
                plus anything finite is -inf, so their order does not matter);
             5. penalties of the rows with slot[row] >= 0: counts / seen are rows of the
                engine's tables [S, V] (int32 output counts, bool prompt-seen; runtime/
                penalty_slots.py), pen [B, 3] float32 = (repetition, frequency, presence).
  advance  after a step's draw: out_len[row] += 1, counts[slot[row], tokens[row]] += 1 (one
           program per row; slots are distinct, so no atomics).
  logprobs per asked row, in two launches (per row x vocab tile, then per row): the raw
           logits' logsumexp, the chosen token's logprob, its rank (1 + the count of logits
           strictly greater than the chosen one) and the top k (tl.topk of each tile on int64
           keys holding the logit and its index, then of the tiles' candidates: the top k of
           the logits are those of the logprobs); out [R, 2 + 2k] float32, the layout the
           host reads (runtime/step_sampling.py).

Each has a plain-torch reference (`*_ref`: the sampler's eager code, the CPU path) and is
tested against it under TRITON_INTERPRET=1 (tests/test_sampling_kernels.py). Unused inputs are
passed as None with their HAS_* flag off: a variant per combination of features, all
enumerated by `aot_launches`. The small index arrays are not specialized on alignment (they
are slices of one packed copy per step), the [*, V] tensors are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import next_pow2, use_triton

NEVER_DONE = 2 ** 31 - 1  # an entry's `need` that out_len never reaches: always applied
_NEG_INF = float("-inf")


def _block(v: int) -> int:
    return min(next_pow2(v), 2048)


@triton.jit(do_not_specialize_on_alignment=["ent_ptr", "ent_tok", "ent_val", "ent_need", "out_len_ptr",
                                            "slot_ptr", "pen_ptr"])
def _stages_kernel(x_ptr, out_ptr, V, mask_ptr, W, ent_ptr, ent_tok, ent_val, ent_need, out_len_ptr,
                   slot_ptr, pen_ptr, counts_ptr, seen_ptr,
                   BLOCK: tl.constexpr, HAS_MASK: tl.constexpr, HAS_ENTRIES: tl.constexpr,
                   HAS_PEN: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < V
    base = row.to(tl.int64) * V
    x = tl.load(x_ptr + base + cols, mask=inside, other=0.0)
    if HAS_MASK:
        word = tl.load(mask_ptr + row.to(tl.int64) * W + cols // 32, mask=inside, other=0)
        x = tl.where(((word >> (cols % 32)) & 1) != 0, x, float("-inf"))
    if HAS_ENTRIES:
        e0 = tl.load(ent_ptr + row)
        e1 = tl.load(ent_ptr + row + 1)
        done = tl.load(out_len_ptr + row)
        for e in range(e0, e1):
            tok = tl.load(ent_tok + e)
            need = tl.load(ent_need + e)
            val = tl.load(ent_val + e)
            x = tl.where((cols == tok) & (done < need), x + val, x)
    if HAS_PEN:
        slot = tl.load(slot_ptr + row)
        if slot >= 0:
            rep = tl.load(pen_ptr + row * 3)
            freq = tl.load(pen_ptr + row * 3 + 1)
            pres = tl.load(pen_ptr + row * 3 + 2)
            at = slot.to(tl.int64) * V + cols
            c = tl.load(counts_ptr + at, mask=inside, other=0)
            seen = tl.load(seen_ptr + at, mask=inside, other=0) != 0
            x = tl.where(seen | (c > 0), tl.where(x > 0, tl.div_rn(x, rep), x * rep), x)
            x = x - freq * c.to(tl.float32)
            x = x - pres * (c > 0).to(tl.float32)
    tl.store(out_ptr + base + cols, x, mask=inside)


@triton.jit(do_not_specialize_on_alignment=["out_len_ptr", "slot_ptr"])
def _advance_kernel(tok_ptr, out_len_ptr, slot_ptr, counts_ptr, V,
                    HAS_LEN: tl.constexpr, HAS_PEN: tl.constexpr):
    row = tl.program_id(0)
    if HAS_LEN:
        tl.store(out_len_ptr + row, tl.load(out_len_ptr + row) + 1)
    if HAS_PEN:
        slot = tl.load(slot_ptr + row)
        if slot >= 0:
            at = counts_ptr + slot.to(tl.int64) * V + tl.load(tok_ptr + row)
            tl.store(at, tl.load(at) + 1)


@triton.jit
def _order_key(x, cols):
    """int64 keys ordered as (x, then the lower index first): x's float bits made
    sign-magnitude-orderable in the high word, 2**31 - 1 - index in the low word."""
    bits = x.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (2147483647 - cols).to(tl.int64)


@triton.jit
def _top(keys, K: tl.constexpr):
    """keys [N] int64 -> its K largest [K], largest first. K == 1 is the max: Triton 3.6's
    tl.topk cannot take K = 1 (its bitonic merge reduces the tile to a scalar, then reshapes it)."""
    if K == 1:
        return tl.max(keys, axis=0, keep_dims=True)
    else:
        return tl.topk(keys, K)


@triton.jit(do_not_specialize_on_alignment=["rows_ptr"])
def _logprobs_part_kernel(x_ptr, rows_ptr, tok_ptr, part_ptr, keys_ptr, V, T,
                          BLOCK: tl.constexpr, K: tl.constexpr):
    r = tl.program_id(0)
    t = tl.program_id(1)
    row = tl.load(rows_ptr + r)
    base = x_ptr + row * V
    chosen = tl.load(base + tl.load(tok_ptr + row))
    cols = t * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(base + cols, mask=cols < V, other=float("-inf"))
    m = tl.max(x, axis=0)
    at = part_ptr + (r * T + t) * 3
    tl.store(at, m)
    tl.store(at + 1, tl.sum(tl.exp(x - m), axis=0))
    tl.store(at + 2, tl.sum((x > chosen).to(tl.int32), axis=0).to(tl.float32))
    if K > 0:
        top = _top(_order_key(x, cols), K)
        tl.store(keys_ptr + (r * T + t) * K + tl.arange(0, K), top)


@triton.jit(do_not_specialize=["k", "width"], do_not_specialize_on_alignment=["rows_ptr"])
def _logprobs_merge_kernel(x_ptr, rows_ptr, tok_ptr, part_ptr, keys_ptr, out_ptr, V, T, k, width,
                           TP: tl.constexpr, K: tl.constexpr):
    r = tl.program_id(0)
    ts = tl.arange(0, TP)
    ok = ts < T
    at = part_ptr + (r * T + ts) * 3
    m_t = tl.load(at, mask=ok, other=float("-inf"))
    s_t = tl.load(at + 1, mask=ok, other=0.0)
    m = tl.max(m_t, axis=0)
    lse = m + tl.log(tl.sum(s_t * tl.exp(m_t - m), axis=0))
    row = tl.load(rows_ptr + r)
    chosen = tl.load(x_ptr + row * V + tl.load(tok_ptr + row))
    out = out_ptr + r * width
    tl.store(out, chosen - lse)
    tl.store(out + 1, tl.sum(tl.load(at + 2, mask=ok, other=0.0), axis=0) + 1.0)
    if K > 0:
        ks = tl.arange(0, TP * K)
        keys = tl.load(keys_ptr + r * T * K + ks, mask=ks < T * K, other=-9223372036854775807)  # below every key
        top = _top(keys, K)
        ordered = (top >> 32).to(tl.int32)
        val = (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        idx = 2147483647 - (top & 0xFFFFFFFF)
        j = tl.arange(0, K)
        tl.store(out + 2 + j, val - lse, mask=j < k)
        tl.store(out + 2 + k + j, idx.to(tl.float32), mask=j < k)


# -- launchers -------------------------------------------------------------------------------------

def stages_triton(x: torch.Tensor, bitmask: torch.Tensor | None, entries: tuple | None,
                  penalties: tuple | None) -> torch.Tensor:
    """x [B, V] float32 contiguous -> a new [B, V] float32. bitmask [B, W] int32 or None;
    entries (ent_ptr [B + 1], ent_tok [E], ent_need [E] int32, ent_val [E] float32, out_len [B]
    int32) or None; penalties (slot [B] int32, pen [B, 3] float32, counts [S, V] int32, seen
    [S, V] bool) or None."""
    assert x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous(), "logits must be contiguous [B, V] float32"
    b, v = x.shape
    out = torch.empty_like(x)
    ep, et, en, ev, ol = entries if entries is not None else (None,) * 5
    slot, pen, counts, seen = penalties if penalties is not None else (None,) * 4
    block = _block(v)
    _stages_kernel[(b, triton.cdiv(v, block))](
        x, out, v, bitmask, (v + 31) // 32, ep, et, ev, en, ol, slot, pen, counts, seen,
        BLOCK=block, HAS_MASK=bitmask is not None, HAS_ENTRIES=entries is not None,
        HAS_PEN=penalties is not None, num_warps=4)
    return out


def advance_triton(tokens: torch.Tensor, out_len: torch.Tensor | None, penalties: tuple | None) -> None:
    """In place: out_len [B] int32 += 1; counts[slot[b], tokens[b]] += 1 where slot[b] >= 0.
    tokens [B] int64."""
    slot, _, counts, _ = penalties if penalties is not None else (None,) * 4
    _advance_kernel[(tokens.shape[0],)](tokens, out_len, slot, counts, counts.shape[1] if counts is not None else 1,
                                        HAS_LEN=out_len is not None, HAS_PEN=penalties is not None, num_warps=1)


def logprobs_triton(x: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """x [B, V] float32 contiguous (raw logits), rows [R] int64 (the asked rows), tokens [B]
    int64, k top logprobs (0..32) -> [R, 2 + 2k] float32 (the `logprobs` layout). Two launches:
    per (row, vocab tile) its max, sum of exp, count above the chosen logit and top-k keys; per
    row their merge (logsumexp, rank, the top k of the tiles' candidates)."""
    assert x.dtype == torch.float32 and x.is_contiguous(), "logits must be contiguous [B, V] float32"
    assert 0 <= k <= 32, f"top logprobs k must be in [0, 32], got {k}"
    (r, v), kp = (rows.shape[0], x.shape[1]), next_pow2(k) if k else 0
    block = _block(v)
    t = triton.cdiv(v, block)
    part = torch.empty(r, t, 3, dtype=torch.float32, device=x.device)
    keys = torch.empty(r, t, kp, dtype=torch.int64, device=x.device) if kp else None
    out = torch.empty(r, 2 + 2 * k, dtype=torch.float32, device=x.device)
    _logprobs_part_kernel[(r, t)](x, rows, tokens, part, keys, v, t, BLOCK=block, K=kp, num_warps=4)
    _logprobs_merge_kernel[(r,)](x, rows, tokens, part, keys, out, v, t, k, 2 + 2 * k, TP=next_pow2(t), K=kp,
                                 num_warps=4)
    return out


# -- references (the CPU path) ----------------------------------------------------------------------

def apply_token_bitmask(x: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """x [B, V] float with -inf where ``bitmask`` [B, ceil(V / 32)] int32 has the token's bit
    clear (in place; returns x)."""
    b, v = x.shape
    if bitmask.shape != (b, (v + 31) // 32):
        raise ValueError(f"token bitmask must be [{b}, {(v + 31) // 32}] for logits {tuple(x.shape)}, "
                         f"got {tuple(bitmask.shape)}")
    bits = torch.arange(32, device=x.device, dtype=torch.int32)
    allowed = ((bitmask.to(torch.int32)[:, :, None] >> bits) & 1).bool().reshape(b, -1)[:, :v]
    return x.masked_fill_(~allowed, _NEG_INF)


def stages_ref(x: torch.Tensor, bitmask: torch.Tensor | None, entries: tuple | None,
               penalties: tuple | None) -> torch.Tensor:
    """Plain torch, the same contract as `stages_triton` (any float x)."""
    x = x.float().clone()
    if bitmask is not None:
        apply_token_bitmask(x, bitmask)
    if entries is not None:
        ep, tok, need, val, out_len = entries
        rows = torch.repeat_interleave(torch.arange(x.shape[0], device=x.device), (ep[1:] - ep[:-1]).long())
        held = out_len[rows] < need
        # -inf entries (bans, min_tokens) first, then the biases: the sampler's stage order
        inf = held & torch.isinf(val)
        x[rows[inf], tok[inf].long()] = _NEG_INF
        add = held & ~torch.isinf(val)
        x.index_put_((rows[add], tok[add].long()), val[add], accumulate=True)
    if penalties is not None:
        slot, pen, counts_t, seen_t = penalties
        rows = (slot >= 0).nonzero().flatten()
        s = slot[rows].long()
        counts, seen = counts_t[s], seen_t[s]
        repetition, frequency, presence = (pen[rows, i:i + 1] for i in range(3))
        y = x[rows]
        rep_seen = seen | (counts > 0)
        y = torch.where(rep_seen, torch.where(y > 0, y / repetition, y * repetition), y)
        y = y - frequency * counts.float() - presence * (counts > 0).float()
        x[rows] = y
    return x


def advance_ref(tokens: torch.Tensor, out_len: torch.Tensor | None, penalties: tuple | None) -> None:
    if out_len is not None:
        out_len += 1
    if penalties is not None:
        slot, _, counts, _ = penalties
        rows = (slot >= 0).nonzero().flatten()
        counts.index_put_((slot[rows].long(), tokens[rows]), torch.ones_like(rows, dtype=counts.dtype),
                          accumulate=True)


def logprobs_ref(x: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """Plain torch, the same contract as `logprobs_triton` (the log-softmax, then gather and
    topk on it; the rank on the raw logits)."""
    raw = x[rows].float()
    lp = torch.log_softmax(raw, dim=-1)
    at = tokens[rows][:, None]
    parts = [lp.gather(1, at), (raw > raw.gather(1, at)).sum(dim=-1, keepdim=True).float() + 1]
    if k:
        top_lp, top_ids = lp.topk(k, dim=-1)
        parts += [top_lp, top_ids.float()]
    return torch.cat(parts, dim=1)


def logprobs(x: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """[R, 2 + 2k] float32 per asked row: the chosen token's raw logprob, its rank (1 + the
    logits strictly above it), the top k logprobs, their token ids (exact in float32 below
    2**24): the layout the host reads in one copy (runtime/step_sampling.py)."""
    x = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    return (logprobs_triton if use_triton(x) else logprobs_ref)(x, rows, tokens, k)


def aot_launches(space) -> None:
    """Every launch the sampler makes (plugins/aot.py): the stages kernel for each combination
    of bitmask / sparse entries / penalties (all off launches nothing), the advance kernel for
    out_len and / or penalties, and the logprobs kernel; logits are [B, V] float32 (the LM
    head's output), the batch size is only the grid."""
    v = space.model.vocab_size
    x = space.fake(1, v, dtype=torch.float32)
    i32 = torch.int32
    mask = space.fake(1, (v + 31) // 32, dtype=i32)
    entries = (space.fake(2, dtype=i32), space.fake(1, dtype=i32), space.fake(1, dtype=i32),
               space.fake(1, dtype=torch.float32), space.fake(1, dtype=i32))
    pens = (space.fake(1, dtype=i32), space.fake(1, 3, dtype=torch.float32), space.fake(4, v, dtype=i32),
            space.fake(4, v, dtype=torch.bool))
    for has_mask in (False, True):
        for ent in (None, entries):
            for pen in (None, pens):
                if has_mask or ent is not None or pen is not None:
                    stages_triton(x, mask if has_mask else None, ent, pen)
    tokens = space.fake(1, dtype=torch.int64)
    for out_len, pen in ((entries[4], None), (None, pens), (entries[4], pens)):
        advance_triton(tokens, out_len, pen)
    for k in (0, 1, 2, 3, 5, 9, 17):  # every power-of-two K up to MAX_LOGPROBS (20)
        logprobs_triton(x, tokens, tokens, k)
