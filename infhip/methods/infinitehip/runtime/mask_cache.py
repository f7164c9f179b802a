"""InfiniteHiP mask caching (paper 000, SPEC §4): which pruning stages a decode step recomputes,
and where each request's cached stage outputs live.

Schedule. A request's sparse decode steps are numbered j = 0, 1, ... from the first one after
its (re)prefill or after its context crossed ``dense_threshold``; j = 0 computes every stage.
Afterwards stage i is recomputed when ``(clock + layer_offset) % refresh_intervals[i] == 0``,
where ``clock`` counts the engine's steps with sparse decode rows (SparsePlanner). Intervals are
multiples of the next stage's (checked by InfiniteHipConfig), so a stage's refresh always comes
with every later stage's: a step is described per layer by one number, the first refreshed stage
(``num_stages`` = none).

One clock for every request means that all requests of a batch past their first step refresh
the same stages at the same layers, so a decode step is described by one refresh pattern and a
CUDA graph per (batch size, pattern) can replay it (runtime/cuda_graphs.py).

Staggering (``stagger_refresh``, on by default) spreads the expensive stage-1 refreshes so no
step pays for all of them at once: the k-th of L InfiniteHiP layers is shifted by
``k * n_refresh(0) // L`` steps (:func:`layer_offsets`), so that a whole-model decode step costs
about the same at every step of the cycle (measured spike reduction in docs/benchmarks.md).
Without staggering every layer refreshes together, as in the paper.

Slots. The cached outputs live in fixed-capacity device tensors per layer (:class:`MaskCache`:
stage i -> int32 [max_slots + 1, k_i] + lens [max_slots + 1]; the last row is the scratch slot
that padding rows of a CUDA graph write) indexed by a per-request slot that :class:`MaskSlots`
hands out on the host (a request keeps its slot while it decodes; a finished or preempted
request's slot is reclaimed when a new request needs one). The lowest free slot goes first, so
the requests decoding at once hold the lowest slots: the key bank keeps rows for slots below
``key_bank_slots`` only.

    >>> [refresh_from(j, j, (16, 8, 4)) for j in range(9)]   # a request alone, from clock 0
    [0, 3, 3, 3, 2, 3, 3, 3, 1]
"""

from __future__ import annotations

import heapq

import torch

from infhip.methods.infinitehip.knobs import PruningStage
from infhip.plugins.infinitehip import PAD


def refresh_from(step: int, clock: int, intervals: tuple[int, ...]) -> int:
    """First stage recomputed at a request's sparse decode step number ``step`` when the
    (layer-shifted) clock reads ``clock`` (len(intervals): none)."""
    if step == 0:
        return 0
    for i, n in enumerate(intervals):
        if clock % n == 0:
            return i
    return len(intervals)


def layer_offsets(num_layers: int, cycle: int, align: int = 1) -> list[int]:
    """Refresh-phase shift of each of ``num_layers`` InfiniteHiP layers over a cycle of
    ``cycle`` steps (n_refresh(0)): evenly spaced, rounded down to multiples of ``align``.

    The runtime aligns them to the last stage's interval: every refresh then falls on a step
    that is a multiple of it, so a cycle has n_refresh(0) / n_refresh(-1) refresh patterns (plus
    "none" and a newcomer's full step) instead of n_refresh(0), and the CUDA graphs of every
    pattern are captured at load (runtime/cuda_graphs.py). The work per cycle is the same; it
    is spread over fewer steps, which a stream does not see: decode runs num_decode_steps (8)
    steps back to back before tokens reach the host.

        >>> layer_offsets(4, 16), layer_offsets(5, 2), layer_offsets(32, 96, align=8)[:6]
        ([0, 4, 8, 12], [0, 0, 0, 1, 1], [0, 0, 0, 8, 8, 8])
    """
    return [k * cycle // num_layers // align * align for k in range(num_layers)]


def refresh_schedule(num_steps: int, intervals: tuple[int, ...], clock: int = 0) -> list[tuple[int, ...]]:
    """The stages recomputed at each of the first ``num_steps`` steps of a request whose first
    sparse decode step ran at ``clock`` (for tests and docs)."""
    n = len(intervals)
    return [tuple(range(refresh_from(j, clock + j, intervals), n)) for j in range(num_steps)]


class MaskSlots:
    """Host bookkeeping: request -> mask-cache slot, and each slot's sparse decode step count."""

    def __init__(self, max_slots: int):
        self.max_slots = max_slots
        self.scratch = max_slots  # MaskCache row written by padding rows (never handed out)
        self._free = list(range(max_slots))  # a heap: the lowest free slot is handed out first
        self._slot: dict[int, int] = {}  # seq_id -> slot
        self._owner: dict[int, object] = {}  # slot -> Sequence (to see when it finished)
        self._steps = [0] * max_slots  # sparse decode steps since the slot's masks were valid

    def _reclaim(self) -> None:
        from infhip.runtime.sequence import SequenceStatus
        for slot, seq in list(self._owner.items()):
            if seq.is_finished or seq.status is not SequenceStatus.RUNNING:
                self.release(seq.seq_id)

    def release(self, seq_id: int) -> None:
        slot = self._slot.pop(seq_id, None)
        if slot is not None:
            del self._owner[slot]
            heapq.heappush(self._free, slot)

    def invalidate(self, seq_id: int) -> None:
        """The request ran something other than a sparse decode step (prefill, dense decode):
        its next sparse decode step recomputes every stage."""
        slot = self._slot.get(seq_id)
        if slot is not None:
            self._steps[slot] = 0

    def next_decode(self, seq) -> tuple[int, int]:
        """(slot, step number j) of the request's next sparse decode step; j = 0: its masks are
        not valid, every stage is recomputed."""
        slot = self._slot.get(seq.seq_id)
        if slot is None:
            self._reclaim()  # finished requests' (lower) slots first
            if not self._free:
                raise RuntimeError(f"more than {self.max_slots} requests decode at once")
            slot = heapq.heappop(self._free)
            self._slot[seq.seq_id], self._owner[slot] = slot, seq
            self._steps[slot] = 0
        step = self._steps[slot]
        self._steps[slot] += 1
        return slot, step


class MaskCache:
    """Device-side cached stage outputs of one layer: stage i -> (int32 [max_slots + 1, k_i]
    ascending PAD-padded survivors, int32 [max_slots + 1] counts); row max_slots is the scratch
    slot (MaskSlots.scratch). With ``bank`` = (Hkv, D, dtype): the rotated key bank of the last
    stage's survivors, [bank_slots + 1, k_last, Hkv, D] (plugins/infinitehip/key_bank.py): one
    row per mask slot below ``bank_slots`` (default: every slot), the last row a scratch that
    the other slots point at and that no step writes or reads (:meth:`bank_rows`). With
    ``value_bank`` (offloaded caches) a value bank of the same layout beside it holds the same
    entries' values, so cached decode steps read no host page."""

    def __init__(self, stages: tuple[PruningStage, ...], max_slots: int, device: torch.device,
                 bank: tuple[int, int, torch.dtype] | None = None, bank_slots: int | None = None,
                 value_bank: bool = False):
        rows = max_slots + 1
        self.selected = [torch.full((rows, s.k), PAD, dtype=torch.int32, device=device) for s in stages]
        self.lens = [torch.zeros(rows, dtype=torch.int32, device=device) for _ in stages]
        self.bank = self.value_bank = None
        self.bank_slots = min(max_slots, bank_slots or max_slots)  # mask slots that own a bank row
        if bank is not None:  # entries are written before they are read (key_bank.py): no fill
            num_kv_heads, head_dim, dtype = bank
            shape = (self.bank_slots + 1, stages[-1].k, num_kv_heads, head_dim)
            self.bank = torch.empty(shape, dtype=dtype, device=device)
            if value_bank:
                self.value_bank = torch.empty(shape, dtype=dtype, device=device)

    @property
    def scratch_bank_row(self) -> int:
        """The bank row of every mask slot without one of its own (written and read by none)."""
        return self.bank_slots

    def bank_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Bank row of each mask slot: its own below bank_slots, else the scratch row."""
        return slots.clamp(max=self.scratch_bank_row)

    @staticmethod
    def bank_bytes(final_k: int, bank_slots: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
        """Device memory of one layer's key bank of bank_slots rows (+ scratch)."""
        return (bank_slots + 1) * final_k * num_kv_heads * head_dim * itemsize
