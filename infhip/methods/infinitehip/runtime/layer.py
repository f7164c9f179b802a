"""The run side of one InfiniteHiP layer (kernels only) of the plan that planner.py makes once
per step (the backend, backend.py, hands it the step's SparseStep).

run (per layer, :class:`InfiniteHipLayer`): decode rows recompute the stages they must (each
from the previous stage's cached or fresh output), store them in the layer's MaskCache, then
attend over sink + the last stage's survivors + stream; prefill blocks run every stage fresh
and the flash-style block-sparse kernel. RoPE: the dynamic styles (config) apply only when some
sparse context exceeds the trained window, unless ``rope_off_in_trained_window`` is off. With
``key_bank``, a refresh of the last stage also rotates its keys into the layer's bank, and
decode attention under dynamic RoPE reads them from there (plugins/infinitehip/key_bank.py)
when every decode row owns a bank row (``key_bank_slots``; otherwise it rotates, same tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from infhip.methods.infinitehip.knobs import InfiniteHipConfig
from infhip.plugins._triton_utils import triton_on
from infhip.plugins.infinitehip import (pruning_stage, sparse_decode_attention, sparse_prefill_attention,
                                        unrotate_keys, write_key_bank)

from .mask_cache import MaskCache
from .planner import SparseStep

if TYPE_CHECKING:
    from infhip.runtime.attention.paged_kv import PagedKV


class InfiniteHipLayer:
    """Run side of one "infinitehip" layer: its stages, RoPE styles and mask cache."""

    def __init__(self, cfg: InfiniteHipConfig, layer: int, max_slots: int, scale: float,
                 inv_freq: torch.Tensor, device: torch.device, group: int = 0,
                 bank_layout: tuple[int, int, torch.dtype] | None = None, value_bank: bool = False,
                 reduce_scores=None):
        """bank_layout: (Hkv, D, dtype) of the KV cache to keep a rotated key bank of
        (uses_key_bank), else None; value_bank: keep the selected values beside it (offloaded
        caches: cached decode steps then read only GPU pages). reduce_scores: tensor parallelism's
        max of the chunk scores over the ranks (pruning_stage), None on one GPU. The rank's mask
        cache, key bank and RoPE are its own; its selections equal every other rank's."""
        assert inv_freq.dtype == torch.float32, "RoPE inv_freq is stored in float32"
        self.cfg, self.scale, self.inv_freq = cfg, scale, inv_freq
        self.layer = layer
        self.group = group  # refresh-phase group (SparsePlanner.layer_group)
        self.stages = cfg.stages_of(layer)
        self.pruning_rope = cfg.pruning_rope_of(layer)
        self.cache = MaskCache(self.stages, max_slots, device, bank=bank_layout, bank_slots=cfg.key_bank_slots,
                               value_bank=value_bank)
        self.reduce_scores = reduce_scores

    def run(self, q: torch.Tensor, kv: PagedKV, block_tables: torch.Tensor, step: SparseStep, out: torch.Tensor,
            dropped: torch.Tensor | None = None) -> None:
        """Write the sparse rows of out [T, Hq, D]; q [T, Hq, D] is already rotated and this
        step's K/V are in the layer's cache ``kv`` (fp8 scales and host twin included, table
        entries < 0 name host pages). dropped: int32 [B] tokens this layer does not hold of each
        sequence (UniPrefill drop histories, compacted KV), None = all held: the key ranges end
        that much earlier in the layer's cache."""
        if step.decode_rows.numel():
            ends = step.decode_ends if dropped is None else step.decode_ends - dropped[step.decode_rows]
            self._decode(q, kv, block_tables, step, out, ends)
        if step.prefill_seqs.numel():
            ends = step.prefill_ends if dropped is None else step.prefill_ends - dropped[step.prefill_seqs]
            if step.staged is None:
                self._prefill(q, kv, block_tables, step, out, ends)
            else:  # the chunks' host pages, copied to a GPU twin (their tables renumbered)
                self._prefill(q, kv.with_host(step.staged.acquire(self.layer)), step.staged.tables, step, out, ends)
                step.staged.release(self.layer)

    def _common(self) -> dict:
        return dict(n_sink=self.cfg.n_sink, n_stream=self.cfg.n_stream, inv_freq=self.inv_freq)

    def _prune_kw(self) -> dict:
        return dict(self._common(), head_normalized=self.cfg.chunk_score == "head_normalized",
                    reduce_scores=self.reduce_scores)

    def _decode(self, q, kv: PagedKV, block_tables, step: SparseStep, out, ends) -> None:
        kw, cache = self._common(), self.cache
        prune_kw = self._prune_kw()
        rope = self.pruning_rope if step.dynamic_rope else "none"
        bank = cache.bank is not None and step.dynamic_rope and step.bank_ok  # else rotate: same tokens
        for i, stage in enumerate(self.stages):
            if not step.refresh[self.group][i]:
                continue
            r = step.stage_rows[self.group][i]  # rows recomputing stage i, indices into the decode rows
            slots, rows = step.decode_slots[r], step.decode_rows[r]
            prev = (None, None) if i == 0 else (cache.selected[i - 1][slots], cache.lens[i - 1][slots])
            sel, num = pruning_stage(q, kv, block_tables[rows], step.decode_q_start[r],
                                     step.decode_q_lens[r], ends[r], *prev,
                                     chunk_size=stage.chunk_size, k=stage.k, block_q=1,
                                     max_candidates=step.max_middle if i == 0 else None,
                                     rope_style=rope, **prune_kw)
            cache.selected[i][slots], cache.lens[i][slots] = sel, num
            if cache.bank is not None and i == len(self.stages) - 1:
                # the new selection's keys, rotated to their ranks once (read by the cached
                # steps); written with or without dynamic RoPE so the bank is valid when it turns on
                write_key_bank(kv, block_tables[rows], ends[r], sel, cache.bank, cache.bank_rows(slots),
                               n_sink=self.cfg.n_sink, inv_freq=self.inv_freq, rope_group=stage.chunk_size,
                               skip_row=cache.scratch_bank_row, value_bank=cache.value_bank)
        rows = step.decode_rows
        selected = cache.selected[-1][step.decode_slots]
        out[rows] = sparse_decode_attention(
            q[rows], kv, block_tables[rows], ends, selected, scale=self.scale,
            rope_style=self.cfg.attention_rope if step.dynamic_rope else "none",
            rope_group=self.stages[-1].chunk_size, bank=cache.bank if bank else None,
            bank_rows=cache.bank_rows(step.decode_slots) if bank else None,
            value_bank=cache.value_bank if bank else None, **kw)

    def _prefill(self, q, kv: PagedKV, block_tables, step: SparseStep, out, ends) -> None:
        kw, prune_kw = self._common(), self._prune_kw()
        tables = block_tables[step.prefill_seqs]
        blocks = (step.prefill_q_start, step.prefill_q_lens, ends)
        rope = self.pruning_rope if step.dynamic_rope else "none"
        raw = None  # dynamic RoPE over many blocks: un-rotate each key once, not once per block
        if step.raw_keys and rope != "none" and triton_on(q, kv.k):
            raw = unrotate_keys(kv, block_tables[step.prefill_seq_rows], step.prefill_seq_ends,
                                self.inv_freq, step.prefill_block_seq, dtype=q.dtype)
        sel = num = None
        for i, stage in enumerate(self.stages):
            sel, num = pruning_stage(q, kv, tables, *blocks, sel, num, chunk_size=stage.chunk_size,
                                     k=stage.k, block_q=self.cfg.block_q, query_stride=self.cfg.query_strides[i],
                                     max_candidates=step.max_middle if i == 0 else None, rope_style=rope,
                                     raw_keys=raw, **prune_kw)
        sparse_prefill_attention(q, kv, tables, *blocks, sel, block_q=self.cfg.block_q,
                                 scale=self.scale, out=out, rope_group=self.stages[-1].chunk_size,
                                 rope_style=self.cfg.attention_rope if step.dynamic_rope else "none", **kw)
