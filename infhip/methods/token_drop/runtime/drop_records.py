"""What the drops of UniPrefill steps leave behind (infhip/methods/token_drop/runtime/step.py makes them): each
sequence's drop history and per-layer retention, recorded after each dropping step and kept by
the transform (infhip/methods/token_drop/runtime/transform.py), by seq_id, not on the sequences."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .step import TokenDropStep

# sequences whose records outlive them: the latest ones that dropped (retention) or finished
# with a drop history (ended), for read-outs after the end (/metrics, evaluations)
KEEP_ENDED = 256


class DropRecords:
    """What the drops of the steps so far leave behind, recorded after each dropping step:

    * ``histories``: seq_id -> per layer, tokens of the sequence's computed ones that layer
      holds no KV for (it did not write them), for the sequences that hold their KV now and
      dropped; what the next steps' per-layer KV reads (drop_histories). A sequence's entry
      goes when its KV is freed (``release``: finished, or preempted, recomputed from 0) or
      when a prefill of it starts from 0;
    * ``ended``: the final histories of the latest KEEP_ENDED finished sequences that dropped;
    * ``retention``: per sequence, kept / total tokens per full-attention layer (tokens that
      ran its MLP) summed over the chunks of its latest prefill (the latest KEEP_ENDED
      sequences). Tests and benchmarks that want the kept positions themselves turn their
      recording on with ``keep_positions()`` (production keeps none)."""

    def __init__(self) -> None:
        self.histories: dict[int, list[int]] = {}
        self.ended: dict[int, list[int]] = {}
        self.retention: dict[int, dict[int, list[int]]] = {}  # seq_id -> {layer: [kept, total]}
        # seq_id -> {full-attention layer: [kept prompt positions of each dropping chunk]}; None: off
        self.kept_positions: dict[int, dict[int, list]] | None = None

    def keep_positions(self) -> dict[int, dict[int, list]]:
        """From now on also record, per sequence id and full-attention layer, the prompt positions
        each dropping chunk kept there (int64 tensors, one per chunk, unbounded: tests and
        benchmarks only). Returns the live dict; a second call returns the same one."""
        if self.kept_positions is None:
            self.kept_positions = {}
        return self.kept_positions

    def history(self, seq_id: int) -> list[int] | None:
        """The drop history of a sequence that holds its KV, else of a recently finished one;
        None: it dropped nothing (or is long gone)."""
        h = self.histories.get(seq_id, self.ended.get(seq_id))
        return list(h) if h is not None else None

    def release(self, seq) -> None:
        """Sequence ``seq``'s KV was freed: its history ends (kept in ``ended`` if it finished)."""
        h = self.histories.pop(seq.seq_id, None)
        if h is not None and seq.is_finished:
            _keep_newest(self.ended, seq.seq_id, h)

    def record(self, seqs: list, step: TokenDropStep, num_layers: int) -> None:
        """seqs: the step's sequences in batch order; step: the step's drop state (TokenDropStep)."""
        for d in step.drops:
            seq = seqs[d.b]
            h = self.histories.get(seq.seq_id) or [0] * num_layers
            for layer, rec in step.records:
                h[layer] += rec[d.b][2] - rec[d.b][0]  # tokens that wrote no KV there
            if any(h):
                self.histories[seq.seq_id] = h
            else:  # kept everything: no history, shared metadata and graphs
                self.histories.pop(seq.seq_id, None)
            per_layer = self.retention.pop(seq.seq_id, {}) if d.start else {}
            _keep_newest(self.retention, seq.seq_id, per_layer)
            for layer, rec in step.records:
                _, kept, total, _ = rec[d.b]
                acc = per_layer.setdefault(layer, [0, 0])
                acc[0] += kept
                acc[1] += total
            if self.kept_positions is not None:
                for layer, rec in step.records:
                    if rec[d.b][3] is not None:
                        self.kept_positions.setdefault(seq.seq_id, {}).setdefault(layer, []).append(rec[d.b][3])


def _keep_newest(records: dict, key, value) -> None:
    """records[key] = value as the newest entry, the oldest ones past KEEP_ENDED dropped."""
    records.pop(key, None)
    records[key] = value
    while len(records) > KEEP_ENDED:
        records.pop(next(iter(records)))
