"""What the drops of UniPrefill steps leave behind (runtime/token_drop.py makes them): drop
histories on the sequences and per-layer retention, recorded after each dropping step."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infhip.runtime.token_drop import TokenDropStep


class DropStats:
    """What the drops of the steps so far leave behind, recorded after each dropping step:
    each dropping sequence's drop history (``Sequence.dropped``: tokens each layer did not
    write, read by the next steps' per-layer KV) and, per sequence, kept / total tokens per
    full-attention layer (tokens that ran its MLP) summed over the chunks of its latest prefill
    (``retention``, the latest 256 sequences). Tests and benchmarks that want the kept positions
    themselves turn their recording on with ``keep_positions()`` (production keeps none)."""

    def __init__(self) -> None:
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

    def record(self, seqs: list, td: TokenDropStep, num_layers: int) -> None:
        """seqs: the step's sequences in batch order; td: the step's drop state (TokenDropStep)."""
        for d in td.drops:
            seq = seqs[d.b]
            if seq.dropped is None:
                seq.dropped = [0] * num_layers
            for layer, rec in td.records:
                seq.dropped[layer] += rec[d.b][2] - rec[d.b][0]  # tokens that wrote no KV there
            if not any(seq.dropped):  # kept everything: no history, shared metadata and graphs
                seq.dropped = None
            per_layer = self.retention.pop(seq.seq_id, {}) if d.start else {}
            self.retention[seq.seq_id] = per_layer  # newest last
            while len(self.retention) > 256:  # bounded: the latest sequences only
                self.retention.pop(next(iter(self.retention)))
            for layer, rec in td.records:
                _, kept, total, _ = rec[d.b]
                acc = per_layer.setdefault(layer, [0, 0])
                acc[0] += kept
                acc[1] += total
            if self.kept_positions is not None:
                for layer, rec in td.records:
                    if rec[d.b][3] is not None:
                        self.kept_positions.setdefault(seq.seq_id, {}).setdefault(layer, []).append(rec[d.b][3])
