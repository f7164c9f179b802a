"""Per-step attention metadata, handed to every attention layer through a forward context.

`forward` of a model block takes tensors only (SPEC §8.2); what an attention layer needs to know
about the step — where to write K/V, which pages to read, how long each sequence is — is planned
once per step on the host (`ModelRunner.prepare` -> `ModelRunner._context`, or `DecodeGraphs`
for a graph's static buffers) and read here by each layer: the common fields below, plus each
attention backend's own device meta under its name (``meta``). The context also picks each
layer's attention backend (runtime/attention/): the layer's own, or a step transform's
(runtime/step_transform.py, e.g. token drop) for the layers it handles.

Token layout of a step (packed, variable length): the rows of the B_dec decode sequences come
first (one query row each), then the prefill chunks of the other sequences, back to back.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from infhip.runtime.attention.dense import DENSE


@dataclass
class KVGroupMetadata:
    """Paging of one KV group (layers sharing a page table: "global" or "sliding")."""

    slot_mapping: torch.Tensor  # [T] int64, flat cache slot of each new token (-1: do not write)
    block_tables: torch.Tensor  # [B, max_pages] int32, logical page -> physical page (0 = null page)


@dataclass
class ForwardContext:
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    context_lens: torch.Tensor  # [B] int32, tokens in the cache after this step, per sequence
    cu_seqlens_q: torch.Tensor  # [B + 1] int32, query rows of sequence b: cu[b]:cu[b+1]
    num_decodes: int  # the first num_decodes sequences have exactly one query row
    groups: dict[str, KVGroupMetadata]
    # Host copies, so prefill attention can loop over sequences without a device sync.
    cu_seqlens_q_list: list[int]
    context_lens_list: list[int]
    # backend name -> its device meta of the step (runtime/attention/backend.py upload /
    # graph_meta); a backend with no row in the step has none.
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    # transform name -> its TransformStep of the step (runtime/step_transform.py): it may route
    # rows through the layer loop, run the layers it handles and give layers their own view
    # (layer_view); a transform that leaves the step untouched has none.
    transforms: dict[str, Any] = dataclasses.field(default_factory=dict)
    # A bound on the decode rows' context lengths that sizes the decode kernel's split count
    # (cuda_graphs.decode_len_bound: eager steps and graphs use the same). None: the table width.
    decode_len_bound: int | None = None
    # linear-attention layers' state slots of the step (runtime/linear_state.py RecurrentMeta);
    # None for a model without such layers
    recurrent: Any = None

    @classmethod
    def of_step(cls, backend_meta: dict, transform_steps: dict, **common) -> "ForwardContext":
        """The one constructor of a step's context (eager: ModelRunner._context, from the
        uploaded StepPlan; graphs: DecodeGraphs._context, views of the static buffers): the
        common fields, then each backend's device meta and each transform's step object, made
        from it by backend_meta / transform_steps (name -> fn(ctx))."""
        ctx = cls(**common)
        ctx.meta = {name: make(ctx) for name, make in backend_meta.items()}
        ctx.transforms = {name: make(ctx) for name, make in transform_steps.items()}
        return ctx

    def for_layer(self, layer: int, group: str) -> "ForwardContext":
        """The context as layer `layer` of KV group `group` sees it: each transform's view
        (its own context lengths and slots when it holds a compacted KV), else this context."""
        ctx = self
        for step in self.transforms.values():
            ctx = step.layer_view(ctx, layer, group)
        return ctx

    def key_shift(self, layer: int) -> torch.Tensor | None:
        """int32 [B] keys that layer ``layer``'s cache lacks of each sequence, when a transform
        compacted its KV (TransformStep.key_shift: its key ranges end that much earlier); None:
        it holds them all."""
        for step in self.transforms.values():
            shift = step.key_shift(layer)
            if shift is not None:
                return shift
        return None

    def run_attention(self, attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Layer ``attn``'s attention of the step: a transform's backend at the layers it handles
        this step; else the layer's own backend (runtime/attention/) with its meta, or the dense
        backend when the layer's backend has no meta this step (its plan gave None: no row of
        the step is its own; a graph whose key leaves it out)."""
        for step in self.transforms.values():
            backend = step.backend_for(attn.layer_index)
            if backend is not None:
                return backend.run(attn, q, k, v, self, None)
        meta = self.meta.get(attn.backend.name)
        return (attn.backend if meta is not None else DENSE).run(attn, q, k, v, self, meta)


@dataclass
class LayerKV:
    """Context lengths and new-token slots of each full-attention layer ("global" group) in a
    step that a step transform's per-layer KV shift touches (token drop: some sequence has a drop
    history): layer l holds its kept keys contiguously, so a token at position p goes to compact
    slot p - dropped[l] of the sequence's page table."""

    rows: dict[int, int]  # layer index -> row of the tensors below
    slot_mapping: torch.Tensor  # [Lg, T] int64
    context_lens: torch.Tensor  # [Lg, B] int32
    context_lens_list: list[list[int]]  # host copy [Lg][B]
    key_shift: torch.Tensor  # [Lg, B] int32: keys each layer lacks of each sequence (the shift)

    @classmethod
    def of_step(cls, p, shift: list[list[int]], global_layers: list[int], tables: torch.Tensor, page_size: int,
                device: torch.device) -> "LayerKV":
        """The LayerKV of StepPlan p whose global layers lack shift [Lg][B] keys of each
        sequence; tables: the global group's block tables on the device. The token at position q
        of sequence b goes to compact slot q - shift[l][b] of b's table."""
        dropped = upload(shift, torch.int64, device)  # [Lg, B]
        lens = torch.tensor(p.cu[1:]) - torch.tensor(p.cu[:-1])
        seq_of_row = upload(torch.repeat_interleave(torch.arange(len(p.ctx_lens)), lens).tolist(), torch.int64, device)
        slots = compact_slots(upload(p.positions, torch.int64, device), seq_of_row, dropped, tables.long(), page_size)
        ctx_lens = [[c - d for c, d in zip(p.ctx_lens, row)] for row in shift]
        return cls(rows={l: i for i, l in enumerate(global_layers)}, slot_mapping=slots,
                   context_lens=upload(ctx_lens, torch.int32, device), context_lens_list=ctx_lens,
                   key_shift=upload(shift, torch.int32, device))


def compact_slots(positions: torch.Tensor, seq_of_row: torch.Tensor, dropped: torch.Tensor,
                  tables: torch.Tensor, page_size: int) -> torch.Tensor:
    """LayerKV.slot_mapping from device tensors (no host sync, graph-capturable): the token at
    position p of sequence b goes to compact index p - dropped[l, b] of b's page table.
    positions / seq_of_row int64 [T], dropped int64 [Lg, B], tables int64 [B, P] -> [Lg, T]."""
    compact = positions[None, :] - dropped[:, seq_of_row]  # [Lg, T]
    pages = tables[seq_of_row[None, :].expand_as(compact), compact // page_size]
    return pages * page_size + compact % page_size


def upload(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (nested for 2-D) as a tensor on device: through pinned memory, non-blocking."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def upload_tables(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """Page lists as an int32 block table [B, max(1, longest)] on device, padded with page 0."""
    width = max(1, max(len(r) for r in rows))
    return upload([r + [0] * (width - len(r)) for r in rows], torch.int32, device)


_CONTEXT: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("attention layer called outside of a forward context (ModelRunner sets it)")
    return _CONTEXT


@contextlib.contextmanager
def forward_context(ctx: ForwardContext):
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ctx
    try:
        yield ctx
    finally:
        _CONTEXT = prev
