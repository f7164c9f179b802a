"""Penalty state that lives on the device across scheduler steps: each penalized sequence's output
token counts and prompt-seen mask are one row (a *slot*) of two tables, counts [S, V] int32 and
seen [S, V] bool, made at its first sampled step and advanced on the device by the sampler
after every draw (plugins/sampling.py, advance). A step then builds nothing of size V on the
host: it hands the sampler its rows' slot numbers.

The host keeps per sequence how many output tokens its row has folded in. Each step checks
that against the sequence's committed output: equal is the rule (the sampler folds exactly the
tokens the engine commits); anything else (a row whose batch failed mid-way and was resampled,
a sequence that took tokens elsewhere) rebuilds the row from the host history, so the counts
are always the committed output's. Slots of finished sequences are reused; the tables grow by
doubling when every slot is held (preempted sequences keep theirs).
"""

from __future__ import annotations

import torch

_FIRST_SLOTS = 8


class PenaltySlots:
    """One engine's (or one stand-alone batch's) penalty tables. Keys: Sequences (the engine,
    whose finished ones are swept) or any hashable (a one-off batch)."""

    def __init__(self, vocab_size: int, device: torch.device | str):
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=self.device)
        self.seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)
        self._held: dict[object, list] = {}  # key -> [slot, output tokens folded]
        self._free: list[int] = []

    def take(self, rows: list[tuple[object, list[int], list[int], bool]]) -> list[int]:
        """The slot of each (key, prompt ids, output ids, needs prompt-seen) row, caught up with
        its output (module docstring); rows without one get a fresh slot, filled from history."""
        fill_o, fill_p, slots = ([], []), ([], []), []
        for key, prompt, out, needs_seen in rows:
            held = self._held.get(key)
            if held is not None and held[1] == len(out):
                slots.append(held[0])
                continue
            if held is None:
                held = self._held[key] = [self._new_slot(), 0]
            s = held[0]
            self.counts[s].zero_()
            self.seen[s].zero_()
            fill_o[0].extend([s] * len(out))
            fill_o[1].extend(out)
            if needs_seen:
                fill_p[0].extend([s] * len(prompt))
                fill_p[1].extend(prompt)
            held[1] = len(out)
            slots.append(s)
        if fill_o[1]:
            idx = torch.tensor(fill_o, dtype=torch.int64).to(self.device)
            self.counts.index_put_((idx[0], idx[1]), torch.ones_like(idx[0], dtype=torch.int32), accumulate=True)
        if fill_p[1]:
            idx = torch.tensor(fill_p, dtype=torch.int64).to(self.device)
            self.seen[idx[0], idx[1]] = True
        return slots

    def folded(self, keys: list[object]) -> None:
        """The sampler folded one more token into each of these keys' rows (on the device)."""
        for k in keys:
            self._held[k][1] += 1

    def _new_slot(self) -> int:
        if not self._free:
            for key in [k for k in self._held if getattr(k, "is_finished", False)]:
                self._free.append(self._held.pop(key)[0])
        if not self._free:
            n = self.counts.shape[0]
            grow = max(n, _FIRST_SLOTS)
            self.counts = torch.cat([self.counts, self.counts.new_zeros(grow, self.vocab_size)])
            self.seen = torch.cat([self.seen, self.seen.new_zeros(grow, self.vocab_size)])
            self._free.extend(range(n + grow - 1, n - 1, -1))
        return self._free.pop()
