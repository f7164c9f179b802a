"""InfiniteHiP mask caching (paper 000, SPEC §4): which pruning stages a decode step recomputes,
and where each request's cached stage outputs live.

Schedule. A request's sparse decode steps are numbered j = 0, 1, ... from the first one after
its (re)prefill or after its context crossed ``dense_threshold``; j = 0 computes every stage.
Afterwards stage i is recomputed at step j when ``(j + phase) % refresh_intervals[i] == 0``.
Intervals are multiples of the next stage's (checked by InfiniteHipConfig), so a stage's
refresh always comes with every later stage's: a step is described by one number, the first
refreshed stage (``num_stages`` = none).

Staggering (``stagger_refresh``, on by default) spreads the expensive stage-1 refreshes so no
step pays for all of them at once: ``phase = slot % n_refresh(0) + layer_offset(layer)``. The
slot term spreads the requests of a batch; the layer term (:func:`layer_offsets`: the k-th of L
InfiniteHiP layers is shifted by ``k * n_refresh(0) // L`` steps) spreads one request's layers,
so that a whole-model decode step costs about the same at every step of the cycle (measured
spike reduction in docs/benchmarks.md). Without staggering every layer and request refreshes
together, as in the paper.

Slots. The cached outputs live in fixed-capacity device tensors per layer (:class:`MaskCache`:
stage i -> int32 [max_slots, k_i] + lens [max_slots]) indexed by a per-request slot that
:class:`MaskSlots` hands out on the host (a request keeps its slot while it decodes; a finished
or preempted request's slot is reclaimed when needed). Fixed capacity and per-row slot indices
keep the decode step graph-capturable later (one graph per batch size and first refreshed stage).

    >>> [refresh_from(j, 0, (16, 8, 4)) for j in range(9)]
    [0, 3, 3, 3, 2, 3, 3, 3, 1]
"""

from __future__ import annotations

import torch

from infhip.config import PruningStage
from infhip.plugins.infinitehip import PAD


def refresh_from(step: int, phase: int, intervals: tuple[int, ...]) -> int:
    """First stage recomputed at a request's sparse decode step ``step`` (len(intervals): none)."""
    if step == 0:
        return 0
    for i, n in enumerate(intervals):
        if (step + phase) % n == 0:
            return i
    return len(intervals)


def layer_offsets(num_layers: int, cycle: int) -> list[int]:
    """Refresh-phase shift of each of ``num_layers`` InfiniteHiP layers over a cycle of
    ``cycle`` steps (n_refresh(0)): evenly spaced.

        >>> layer_offsets(4, 16), layer_offsets(5, 2)
        ([0, 4, 8, 12], [0, 0, 0, 1, 1])
    """
    return [k * cycle // num_layers for k in range(num_layers)]


def refresh_schedule(num_steps: int, intervals: tuple[int, ...], phase: int = 0) -> list[tuple[int, ...]]:
    """The stages recomputed at each of the first ``num_steps`` steps (for tests and docs)."""
    n = len(intervals)
    return [tuple(range(refresh_from(j, phase, intervals), n)) for j in range(num_steps)]


class MaskSlots:
    """Host bookkeeping: request -> mask-cache slot, and each slot's sparse decode step count."""

    def __init__(self, max_slots: int, intervals: tuple[int, ...], stagger: bool):
        self.max_slots, self.intervals, self.stagger = max_slots, intervals, stagger
        self._free = list(range(max_slots - 1, -1, -1))  # pop() hands out slot 0 first
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
            self._free.append(slot)

    def invalidate(self, seq_id: int) -> None:
        """The request ran something other than a sparse decode step (prefill, dense decode):
        its next sparse decode step recomputes every stage."""
        slot = self._slot.get(seq_id)
        if slot is not None:
            self._steps[slot] = 0

    def next_decode(self, seq) -> tuple[int, int]:
        """(slot, first stage to recompute) for the request's next sparse decode step (no
        layer offset)."""
        slot, step, phase = self.next_decode_state(seq)
        return slot, refresh_from(step, phase, self.intervals)

    def next_decode_state(self, seq) -> tuple[int, int, int]:
        """(slot, step number j, slot phase) of the request's next sparse decode step; the first
        stage a layer recomputes is refresh_from(j, phase + that layer's offset, intervals)."""
        slot = self._slot.get(seq.seq_id)
        if slot is None:
            if not self._free:
                self._reclaim()
            if not self._free:
                raise RuntimeError(f"more than {self.max_slots} requests decode at once")
            slot = self._free.pop()
            self._slot[seq.seq_id], self._owner[slot] = slot, seq
            self._steps[slot] = 0
        phase = slot % self.intervals[0] if self.stagger else 0
        step = self._steps[slot]
        self._steps[slot] += 1
        return slot, step, phase


class MaskCache:
    """Device-side cached stage outputs of one layer: stage i -> (int32 [max_slots, k_i]
    ascending PAD-padded survivors, int32 [max_slots] counts)."""

    def __init__(self, stages: tuple[PruningStage, ...], max_slots: int, device: torch.device):
        self.selected = [torch.full((max_slots, s.k), PAD, dtype=torch.int32, device=device) for s in stages]
        self.lens = [torch.zeros(max_slots, dtype=torch.int32, device=device) for _ in stages]
