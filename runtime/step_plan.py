"""StepPlan: the host-side inputs of one step, in batch order (decodes first).

``ModelRunner.prepare`` builds one per step from the scheduler's chunks (``StepPlan.of_chunks``
the flat lists; the attention backends' and step transforms' host decisions on top); a run of back-to-back
decode steps derives the later ones with ``next_decode``. Nothing here touches the device: the
runner uploads a plan into a ForwardContext (eager) or DecodeGraphs loads it (graph replay).
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import Any

from infhip.plugins.plan_rules import DECODE_LEN_BUCKETS


@dataclass
class StepPlan:
    """Flat token lists, the prefix sums of query rows, and per KV group the cache slot of each
    new token and each sequence's page table."""

    input_ids: list[int]
    positions: list[int]
    cu: list[int]  # [B + 1] query-row prefix sums
    ctx_lens: list[int]  # [B] tokens in the cache after the step
    logits_rows: list[int]  # rows whose logits are sampled
    slots: dict[str, list[int]]
    tables: dict[str, list[list[int]]]  # the cache manager's live page lists (read-only, this step)
    num_decodes: int
    # backend name -> its host meta of the step (runtime/attention/backend.py plan); a backend
    # with no row in the step has none
    backends: dict[str, Any] = dataclasses.field(default_factory=dict)
    # transform name -> its host meta of the step (runtime/step_transform.py plan); a transform
    # that leaves the step untouched has none. A run of decode steps shares the first's.
    transforms: dict[str, Any] = dataclasses.field(default_factory=dict)
    hidden_rows: list[int] | None = None  # rows whose hidden states the runner keeps (prompt logprobs)
    # the recurrent-state slot of each sequence (batch order) when the model has linear-attention
    # layers (runtime/linear_state.py); None otherwise
    recurrent_slots: list[int] | None = None

    @property
    def has_backend_rows(self) -> bool:
        """Whether some registered backend serves rows of this step (else every layer runs dense)."""
        return bool(self.backends)

    def len_bucket(self, table_tokens: int) -> int | None:
        """The short-context bucket of the decode rows (the smallest of DECODE_LEN_BUCKETS that
        holds their longest context, plugins/plan_rules.len_bucket; bisect here: the runner asks
        every step). None: a backend's rows, no decode row, or a bucket no shorter than the
        block-table width of table_tokens (the start-up graphs are that bound)."""
        if self.backends or not self.num_decodes:
            return None
        i = bisect.bisect_left(DECODE_LEN_BUCKETS, max(self.ctx_lens[:self.num_decodes]))
        return DECODE_LEN_BUCKETS[i] if i < len(DECODE_LEN_BUCKETS) and DECODE_LEN_BUCKETS[i] < table_tokens else None

    def decode_len_bound(self, table_tokens: int) -> int:
        """The bound that sizes dense decode's split count: the length bucket, else the table
        width; the same for an eager step and the graph that would replay it (DecodeGraphs), so
        both split (and round) alike."""
        return self.len_bucket(table_tokens) or table_tokens

    @classmethod
    def of_chunks(cls, chunks, kv, groups: list[str]) -> "StepPlan":
        """The flat lists of a step's chunks (scheduler order: decodes first); kv: the
        KVCacheManager whose pages the scheduler allocated (read only here)."""
        input_ids, positions, cu, ctx_lens, logits_rows = [], [], [0], [], []
        slots = {g: [] for g in groups}
        tables = {g: [] for g in groups}
        num_decodes = 0
        for i, ch in enumerate(chunks):
            seq = ch.seq
            if ch.num_tokens == 1 and num_decodes == i:
                num_decodes += 1
            if ch.num_tokens == 1 and ch.end == seq.num_tokens:
                input_ids.append(seq.last_token_id)  # decode: no copy of the whole token list
            else:
                input_ids += seq.all_token_ids[ch.start:ch.end]
            positions += range(ch.start, ch.end)
            cu.append(cu[-1] + ch.num_tokens)
            ctx_lens.append(ch.end)
            if ch.needs_logits:
                logits_rows.append(cu[-1] - 1)
            for g in groups:
                slots[g] += kv.slot_mapping(seq.seq_id, g, ch.start, ch.end)
                tables[g].append(kv.page_list(seq.seq_id, g))  # live lists: read within this step
        return cls(input_ids=input_ids, positions=positions, cu=cu, ctx_lens=ctx_lens, logits_rows=logits_rows,
                   slots=slots, tables=tables, num_decodes=num_decodes)

    def next_decode(self, j: int, chunks, kv) -> "StepPlan":
        """Step j of a run of decode steps whose first is this plan (the same batch, j positions
        further; its pages already allocated); the caller plans its backends' rows."""
        starts = [ch.start for ch in chunks]
        slots = {g: [kv.slot_mapping(ch.seq.seq_id, g, s + j, s + j + 1)[0] for ch, s in zip(chunks, starts)]
                 for g in self.slots}
        return dataclasses.replace(self, positions=[s + j for s in starts], ctx_lens=[s + j + 1 for s in starts],
                                   slots=slots, backends={})
