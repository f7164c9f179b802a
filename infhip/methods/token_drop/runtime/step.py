"""UniPrefill token dropping in the runtime (paper 004; kernels in plugins/token_drop).

What a *prefill pass* is here: one scheduler chunk of one sequence. Its observation window is
the chunk's last n = obs_window queries; they score every key the drop layer holds for the
sequence (earlier chunks' kept keys, gathered from the cache, and all of the chunk's own), with
the softmax over all of them. Only the chunk's own blocks can be dropped (earlier chunks' KV is
final); top-p keeps the smallest set of the chunk's blocks holding fraction p of the mass the
chunk's blocks receive. Blocks are G-aligned in the layer's key list (earlier kept keys, then
the chunk), so a chunk starting mid-block selects that block as a whole and keeps its own part. A chunk drops nothing when its prompt is shorter
than min_prompt_len or it has fewer than G droppable tokens (after sinks and the kept tail);
decode rows never drop. One step may mix decodes, dropping and non-dropping prefill chunks.

The schedule (TokenDropConfig drop_layers / drop_point / reenter; resolve_drop_layers): drops
happen at the *drop layers* (full-attention layers). At a drop layer, with the rows flowing now
(the whole batch, or the rows kept by earlier drops):

    x -> input norm -> q, k, v of the current rows; RoPE at original positions
    -> importance: the chunk's last n queries vs every key the layer holds (its earlier kept keys
       and the chunk's current keys), blocks of G over that key list -> top-p keep set S
    after_attention (default, the authors' vLLM code):
       K/V of all current rows written; their attention and o_proj; then only S continues:
       the layer's MLP and every later layer
    before_attention (the paper's Eq. 8):
       K/V of S only written; attention of S over the layer's earlier keys + S (causal); the
       rest of the layer and every later layer on S
    reenter=False (default, the authors' code): dropped rows never come back (the kept set only
    shrinks); reenter=True (the paper): they re-enter at the next drop layer with their stream
    as it was when dropped (before: at the drop layer's input; after: after its attention), and
    that layer chooses again among all rows.

Full-attention layers that are not drop layers run the current rows (compact after a drop).
The paper's remark that dropped tokens are not attended to holds in both: a layer's keys are the
rows that ran it. The stream is carried as (hidden, residual); a dropped row's saved state is
hidden + residual at the point of the drop.

KV, per layer:
* A token writes KV exactly at the layers whose attention it runs: dropped at layer l before
  attention, none at l; after attention, at l and not after (until it re-enters). A
  full-attention layer stores the keys it holds contiguously in the sequence's page table
  (compact slot = position - tokens that layer dropped before), so each (sequence, layer) has
  its own length. The transform keeps each sequence's drop history (per layer, DropRecords
  ``histories`` by seq_id, while the sequence holds its KV), and steps with such a
  sequence carry per-layer context lengths and slots of the full-attention layers in the
  forward context (`forward_context.LayerKV`, computed in one vectorised pass); layers read
  them through `ForwardContext.for_layer`. Steps without a drop history use the shared metadata unchanged;
  decode steps with one replay the per-layer-KV CUDA graphs (runtime/cuda_graphs.py: lengths
  and slots computed inside the graph from the dropped counts).
* A sliding-window layer (Gemma-3) writes K/V only for the rows flowing through it, at the
  slots of their original positions (its page table stays per position). The slots of dropped
  tokens are never read: every pass keeps its last max(n, largest window) tokens, so the last W
  positions of any sequence are written at every layer, which is all a sliding decode query (or
  the next chunk's) reads. Within the pass, kept queries of a sliding layer attend to the kept
  keys by their true positions (plugins/token_drop/attention.py). Cost of this rule:
  max(n, W) - n more kept tokens per pass (896 for Gemma-3-12B's 1024 window: 0.7% of 128K).
* Pages are allocated for every position as without dropping: no KV memory is saved.

With InfiniteHiP layers (token-drop prefill, sparse decode):
* A step with a dropping chunk runs no sparse attention: token drop's kernels attend densely at
  the layers it handles (its own kept rows, and the step's decode rows and other prefill chunks
  at the layers it handles), every other layer takes the dense path; the mask caches of the step's decode
  rows are invalidated (their next sparse step recomputes every stage).
* Afterwards each InfiniteHiP layer prunes and attends over the keys it holds: its compacted KV,
  whose length is the request's context minus what that layer dropped (the ends the sparse
  plugins see are shifted per layer, SparseStep + LayerKV, eager or in a CUDA graph).
* Only inside the trained window: token drop is skipped for requests whose prompt + max_tokens
  exceed it (plan_drops' max_context). Past the window two things break: token drop's own
  prefill attention is dense at original positions (out of the model's range, exactly where
  InfiniteHiP's dynamic RoPE is needed), and dynamic RoPE in the sparse kernels rotates keys by
  their index in the layer's cache, which after a drop is not the original position. Inside
  it InfiniteHiP keeps the stored rotations and the composition is exact (tested against dense
  attention over the same kept keys). Lifting the limit needs a sparse token-drop prefill and
  the original position of each cached key in the sparse kernels.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch
import triton

from infhip.methods.token_drop.knobs import TokenDropConfig
from infhip.plugins.dense_attention import gather_kv
from infhip.plugins.rope import apply_rope_, write_kv
from infhip.plugins.token_drop import block_importance
from infhip.plugins.token_drop.attention import kept_attention
from infhip.runtime.attention.dense import DENSE
from infhip.runtime.forward_context import KVGroupMetadata, LayerKV
from infhip.runtime.step_transform import TransformStep


@dataclass(frozen=True)
class DropChunk:
    """A prefill chunk that drops this step: batch index b, positions [start, end)."""

    b: int
    start: int
    end: int


def keep_tail(cfg: TokenDropConfig, windows: list[int | None]) -> int:
    """Tokens always kept at the end of a pass: the observation window, and on models with
    sliding layers at least the largest window (decode reads the last W positions at every
    sliding layer, so they must have been written there)."""
    return max([cfg.obs_window] + [w for w in windows if w is not None])


def never_drops(seq, cfg: TokenDropConfig | None, max_context: int | None = None) -> bool:
    """Whether no chunk of ``seq`` drops tokens under ``cfg`` (None: token drop off): its prompt
    is shorter than min_prompt_len, or (``max_context``, InfiniteHiP engines) it may grow past
    the trained window. Its pages then hold what a plan without token drop computes (prefix
    caching reuses them: docs/design/prefix_caching.md)."""
    if cfg is None or seq.num_prompt_tokens < cfg.min_prompt_len:
        return True
    return max_context is not None and seq.num_prompt_tokens + seq.params.max_tokens > max_context


def plan_drops(chunks, cfg: TokenDropConfig, tail: int, max_context: int | None = None) -> list[DropChunk]:
    """The chunks of a step (scheduler order) that drop: long-enough prompts, not decodes, at
    least G droppable tokens besides sinks and the kept tail; with ``max_context`` (engines with
    InfiniteHiP layers: the trained window) only requests that cannot grow past it."""
    drops = []
    for b, ch in enumerate(chunks):
        if ch.num_tokens == 1 or never_drops(ch.seq, cfg, max_context):
            continue
        droppable = ch.num_tokens - tail - max(0, cfg.num_sink - ch.start)
        if droppable >= cfg.block_size:
            drops.append(DropChunk(b, ch.start, ch.end))
    return drops


def drop_histories(chunks, global_layers: list[int], histories: dict[int, list[int]]) -> list[list[int]] | None:
    """[global layer][b] tokens each full-attention layer lacks of the step's sequence b (its
    drop history in ``histories``, seq_id -> per layer; a prefill from scratch starts a new
    one), None when no sequence has one."""
    for ch in chunks:
        if ch.start == 0:  # a prefill from scratch (first or after preemption): no history
            histories.pop(ch.seq.seq_id, None)
    rows = [histories.get(ch.seq.seq_id) for ch in chunks]
    if all(h is None for h in rows):
        return None
    return [[h[l] if h is not None else 0 for h in rows] for l in global_layers]


@dataclass
class TokenDropStep(TransformStep):
    """Token drop's object of one forward pass (runtime/step_transform.py), read by the layer
    loop and the layers through the forward context: the drops of the step's dropping chunks
    (none in a step that only has drop histories) and the per-layer KV of the sequences with a
    drop history.

    After a drop the batch is compact: rows `idx` (ascending) of the full batch, with their
    positions, slots and per-sequence offsets below. `records` collects, per full-attention
    layer, the tokens of each dropping chunk that wrote its KV and that ran its MLP."""

    cfg: TokenDropConfig | None  # None: token drop off (drop histories only, no drops)
    drops: list[DropChunk]
    full: frozenset[int]  # full-attention layers
    drop_at: frozenset[int]  # the layers that drop (resolve_drop_layers: spared ones left out)
    tail: int
    # (scores, cu_blocks, cu_ext, p, **kw) -> the selection (TokenDrop.keep_blocks: top-p)
    keep_blocks: Callable
    # per-layer context lengths and slots of the full-attention layers (some sequence of the
    # step has a drop history); None: every layer holds every position
    layer_kv: LayerKV | None = None
    idx: torch.Tensor | None = None  # [M] int64 kept rows; None = the full batch flows
    saved: torch.Tensor | None = None  # [T, hidden] stream of the rows dropped so far, when dropped
    pending: tuple | None = None  # the drop the current layer chose, applied after its attention
    positions: torch.Tensor | None = None  # [M] compact positions
    slots: dict[str, torch.Tensor] = field(default_factory=dict)  # sliding group -> [M] slots (per position)
    cu: list[int] = field(default_factory=list)  # [B + 1] compact query offsets (host)
    cu_t: torch.Tensor | None = None
    kept_pos: dict[int, torch.Tensor] = field(default_factory=dict)  # b -> host positions flowing
    # per full-attention layer: (layer, {b: (KV written, MLP rows, total, MLP rows' positions or None)})
    records: list[tuple[int, dict[int, tuple[int, int, int, torch.Tensor | None]]]] = field(default_factory=list)

    name = "token_drop"

    @property
    def after(self) -> bool:
        return self.cfg.drop_point == "after_attention"

    @property
    def routes(self) -> bool:
        return bool(self.drops)

    def layer_view(self, ctx, layer: int, group: str):
        """Layer `layer`'s own context lengths and slots when it holds a compacted KV (LayerKV;
        the keys it lacks of each sequence: key_shift); else ctx."""
        lk = self.layer_kv
        if lk is None or layer not in lk.rows:
            return ctx
        r = lk.rows[layer]
        groups = dict(ctx.groups)
        groups[group] = KVGroupMetadata(lk.slot_mapping[r], ctx.groups[group].block_tables)
        return dataclasses.replace(ctx, context_lens=lk.context_lens[r], context_lens_list=lk.context_lens_list[r],
                                   groups=groups)

    def key_shift(self, layer: int) -> torch.Tensor | None:
        lk = self.layer_kv
        return lk.key_shift[lk.rows[layer]] if lk is not None and layer in lk.rows else None

    def flowing_rows(self) -> tuple[torch.Tensor, list[int]] | None:
        return (self.cu_t, self.cu) if self.idx is not None else None

    def attended_rows(self) -> torch.Tensor | None:
        return self.pending[0] if self.pending is not None and not self.after else None

    # -- the stream -------------------------------------------------------------------------
    def enter_layer(self, i: int, hidden: torch.Tensor, residual: torch.Tensor | None):
        """Before layer i: with re-entry, the dropped rows come back at a drop layer (Eq. 8).
        A full-attention layer the full batch runs on its own backend is recorded as kept-all."""
        if self.cfg.reenter and i in self.drop_at and self.idx is not None:
            hidden, residual = self.reconstitute(hidden, residual)
        if i in self.full and not self.handles_layer(i):
            self.records.append((i, {d.b: (d.end - d.start,) * 3 + (None,) for d in self.drops}))
        return hidden, residual

    def reconstitute(self, hidden: torch.Tensor, residual: torch.Tensor | None):
        """(hidden, residual) of the compact rows -> (full stream, None)."""
        if self.idx is None:
            return hidden, residual
        stream = hidden if residual is None else hidden + residual
        full = self.saved.clone().index_copy_(0, self.idx, stream)
        self.idx = self.saved = None
        self.kept_pos = {}
        return full, None

    def after_attention(self, i: int, hidden: torch.Tensor, residual: torch.Tensor):
        """After layer i's attention, at the layer that just chose a drop (`pending`): save the dropped rows' stream and
        continue with the kept rows only. before_attention: `hidden` (the attention output)
        has the kept rows already and the saved stream is the layer's input; after_attention:
        both are narrowed and the saved stream includes the layer's attention."""
        if self.pending is None:
            return hidden, residual
        sel, idx, cu, positions, slots = self.pending
        self.pending = None
        if self.after:
            stream = hidden + residual
            hidden = hidden.index_select(0, sel)
        else:
            stream = residual
        if self.idx is None:
            self.saved = stream
        else:
            self.saved.index_copy_(0, self.idx, stream)
        self.idx, self.cu, self.positions, self.slots = idx, cu, positions, slots
        self.cu_t = torch.tensor(cu, dtype=torch.int32).to(sel.device)
        return hidden, residual.index_select(0, sel)

    # -- attention: the backend of the layers it handles (ForwardContext.run_attention) ------------
    def handles_layer(self, layer: int) -> bool:
        """In a step with drops, drop layers and every layer while rows are dropped take this
        backend; the layers before the first drop (and spared drop layers) run the full batch
        on their own."""
        return bool(self.drops) and (layer in self.drop_at or self.idx is not None)

    def backend_for(self, layer: int):
        return self if self.handles_layer(layer) else None

    def run(self, attn, q, k, v, ctx, meta=None) -> torch.Tensor:
        """Attention of one layer in a dropping step (ctx: the layer's view of the forward
        context, ForwardContext.for_layer; meta: none): writes K/V, returns [rows out, Hq, D]."""
        if attn.window is None:
            return self._full_layer(attn, q, k, v, ctx, select=attn.layer_index in self.drop_at)
        return self._compact(attn, q, k, v, ctx)

    def _dense_rows(self, attn, q, k, v, out, ctx, meta, cu: list[int], cu_t: torch.Tensor) -> None:
        """Decode rows and non-dropping prefill chunks (rows cu[b]:cu[b+1] of q): the dense
        backend's calls."""
        nd = ctx.num_decodes
        if nd:
            # sized by the step's length bound, as the dense backend does: the split count then
            # depends on plan buckets, not on the table width (so its kernels are enumerable)
            DENSE.decode(attn, q[:nd], out[:nd], meta.block_tables[:nd], ctx.context_lens[:nd], ctx.decode_len_bound)
        dropping = {d.b for d in self.drops}
        b, num_seqs = nd, len(ctx.context_lens_list)
        while b < num_seqs:  # runs of consecutive non-dropping prefill chunks
            if b in dropping:
                b += 1
                continue
            hi = b
            while hi < num_seqs and hi not in dropping:
                hi += 1
            first, last = cu[b], cu[hi]
            out[first:last] = DENSE.prefill(
                attn, q[first:last], k[first:last], v[first:last], meta.block_tables[b:hi], cu_t[b:hi + 1] - first,
                ctx.context_lens[b:hi], [c - first for c in cu[b:hi + 1]], ctx.context_lens_list[b:hi])
            b = hi

    def _full_layer(self, attn, q, k, v, ctx, select: bool) -> torch.Tensor:
        """A full-attention layer over the rows flowing now (all, or the compact ones). A
        dropping chunk's current rows hold its compact slots in this layer's view (its j-th row
        at the chunk's j-th slot: earlier drops at this layer shift the rest). With `select`
        (a drop layer) its rows are scored first: before_attention, only the kept rows write
        K/V and attend; after_attention, all current rows do and the drop follows."""
        meta, rope = ctx.groups[attn.kv_group], attn.rope[0]
        compact = self.idx is not None
        cu = self.cu if compact else ctx.cu_seqlens_q_list
        cu_t = self.cu_t if compact else ctx.cu_seqlens_q
        positions = self.positions if compact else ctx.positions
        full_cu = ctx.cu_seqlens_q_list
        dev = q.device
        apply_rope_(q, k, positions, rope.inv_freq, rope.attention_scaling)
        in_drop = torch.zeros(q.shape[0], dtype=torch.bool)  # [M] rows of dropping chunks (K/V below)
        for d in self.drops:
            in_drop[cu[d.b]:cu[d.b + 1]] = True
        slots = meta.slot_mapping.index_select(0, self.idx) if compact else meta.slot_mapping
        write_kv(k, v, attn.kv, torch.where(in_drop.to(dev), -1, slots))
        out = torch.empty_like(q)
        self._dense_rows(attn, q, k, v, out, ctx, meta, cu, cu_t)

        prev = [ctx.context_lens_list[d.b] - (d.end - d.start) for d in self.drops]  # compact earlier KV
        keep_host = None
        if select:
            keys = []
            for d, n_prev in zip(self.drops, prev):
                chunk = k[cu[d.b]:cu[d.b + 1]]
                if n_prev:
                    ck, _ = gather_kv(attn.kv, meta.block_tables[d.b], 0, n_prev, dtype=q.dtype)
                    chunk = torch.cat([ck, chunk])
                keys.append(chunk)
            # one host read per drop layer: the kept rows size everything below
            keep_host = self._select(attn, q, keys, prev, cu, positions).cpu()
        record = {}
        for d, n_prev in zip(self.drops, prev):
            r0, r1 = cu[d.b], cu[d.b + 1]
            cur = self.kept_pos[d.b] if compact else torch.arange(d.start, d.end)  # host positions of the rows
            kept = torch.nonzero(keep_host[r0:r1]).flatten() if select else torch.arange(r1 - r0)
            writes = torch.arange(r1 - r0) if self.after or not select else kept
            rows = (writes + r0).to(dev)
            n = rows.numel()
            qk, kk, vk = q.index_select(0, rows), k.index_select(0, rows), v.index_select(0, rows)
            write_kv(kk, vk, attn.kv, meta.slot_mapping[full_cu[d.b]:full_cu[d.b] + n])
            ctx_len = n_prev + n
            out.index_copy_(0, rows, DENSE.prefill(
                attn, qk, kk, vk, meta.block_tables[d.b:d.b + 1], torch.tensor([0, n], dtype=torch.int32, device=dev),
                torch.tensor([ctx_len], dtype=torch.int32, device=dev), [0, n], [ctx_len]))
            self.kept_pos[d.b] = cur[kept]
            record[d.b] = (n, kept.numel(), d.end - d.start, self.kept_pos[d.b])
        self.records.append((attn.layer_index, record))
        if keep_host is None or bool(keep_host.all()):  # nothing dropped: the same rows flow on
            return out
        sel = torch.nonzero(keep_host).flatten().to(dev)  # current rows kept
        counts = torch.tensor([0] + [int(keep_host[cu[b]:cu[b + 1]].sum()) for b in range(len(cu) - 1)])
        self.pending = (sel, sel if not compact else self.idx.index_select(0, sel), torch.cumsum(counts, 0).tolist(),
                        positions.index_select(0, sel),
                        {g: (m.slot_mapping if not compact else self.slots[g]).index_select(0, sel)
                         for g, m in ctx.groups.items() if g != attn.kv_group})
        return out if self.after else out.index_select(0, sel)

    def _select(self, attn, q, keys: list[torch.Tensor], prev: list[int], cu: list[int],
                positions: torch.Tensor) -> torch.Tensor:
        """[M] bool keep mask of the current rows (True for every row of non-dropping chunks).
        keys[i]: the prev[i] keys the layer already holds for drop i, then its chunk's current keys."""
        cfg = self.cfg
        n, G = cfg.obs_window, cfg.block_size
        q_win = torch.cat([q[cu[d.b + 1] - n:cu[d.b + 1]] for d in self.drops]).contiguous()
        k_all = torch.cat(keys).contiguous() if len(keys) > 1 else keys[0].contiguous()
        cu_k = [0]
        for kk in keys:
            cu_k.append(cu_k[-1] + kk.shape[0])
        scores, _ = block_importance(q_win, k_all, torch.tensor(cu_k, dtype=torch.int32, device=q.device),
                                     attn.scale, n, G, cu_seqlens_list=cu_k, q_window=True)
        # Tensor parallelism: each rank scored its own query heads; the paper's score sums over
        # all of them, so sum over the ranks (identical bits everywhere: every rank keeps the same rows).
        scores = attn.tp.all_reduce(scores)
        # Blocks are G-aligned in the key list (earlier kept keys, then the chunk's current
        # rows), so the chunk spans blocks [start // G, cdiv(end, G)) with start = prev; a
        # selection "sequence" is the G-aligned range [start // G * G, end), its block g being block g0 + g.
        dev = q.device
        block_idx, ext_rows, drop_rows, cu_blocks, cu_ext = [], [], [], [0], [0]
        blocks_before = 0
        for d, start in zip(self.drops, prev):
            end = start + cu[d.b + 1] - cu[d.b]
            g0, nb = start // G, triton.cdiv(end, G)
            block_idx.append(torch.arange(blocks_before + g0, blocks_before + nb, device=dev))
            blocks_before += nb
            cu_blocks.append(cu_blocks[-1] + nb - g0)
            phase = start - g0 * G
            ext_rows.append(torch.arange(cu_ext[-1] + phase, cu_ext[-1] + phase + end - start, device=dev))
            cu_ext.append(cu_ext[-1] + end - g0 * G)
            drop_rows.append(torch.arange(cu[d.b], cu[d.b + 1], device=dev))
        scores_c = scores.index_select(0, torch.cat(block_idx))
        args = (scores_c, torch.tensor(cu_blocks, dtype=torch.int32, device=dev),
                torch.tensor(cu_ext, dtype=torch.int32, device=dev))
        kw = dict(num_tokens=cu_ext[-1], max_seqlen=max(b - a for a, b in zip(cu_ext, cu_ext[1:])),
                  block_size=G, num_sink=0, obs_window=self.tail)
        sel = self.keep_blocks(*args, cfg.p, **kw)
        drop_rows_t = torch.cat(drop_rows)
        kept = sel.keep_mask.index_select(0, torch.cat(ext_rows))
        kept |= positions.index_select(0, drop_rows_t) < cfg.num_sink  # attention sinks
        keep = torch.ones(q.shape[0], dtype=torch.bool, device=dev)
        return keep.index_copy_(0, drop_rows_t, kept)

    def _compact(self, attn, q, k, v, ctx) -> torch.Tensor:
        """A sliding layer after a drop: the compact rows only."""
        meta, W = ctx.groups[attn.kv_group], attn.window
        DENSE.rope_and_write(attn, q, k, v, self.positions, self.slots[attn.kv_group])
        out = torch.empty_like(q)
        self._dense_rows(attn, q, k, v, out, ctx, meta, self.cu, self.cu_t)
        for d in self.drops:
            r0, r1 = self.cu[d.b], self.cu[d.b + 1]
            q_pos = self.kept_pos[d.b]
            kv0 = max(0, d.start - W + 1)  # earlier keys in reach: all written (kept tails)
            kk, vv = k[r0:r1], v[r0:r1]
            k_pos = q_pos
            if kv0 < d.start:
                ck, cv = gather_kv(attn.kv, meta.block_tables[d.b], kv0, d.start, dtype=q.dtype)
                kk, vv = torch.cat([ck, kk]), torch.cat([cv, vv])
                k_pos = torch.cat([torch.arange(kv0, d.start), q_pos])
            out[r0:r1] = kept_attention(q[r0:r1], q_pos, kk, vv, k_pos, attn.scale, W)
        return out


__all__ = ["DropChunk", "TokenDropStep", "keep_tail", "never_drops", "plan_drops"]
