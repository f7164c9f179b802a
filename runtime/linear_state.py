"""Per-sequence recurrent state of the linear-attention layers (Qwen3-Next's gated DeltaNet),
beside the paged KV of its full-attention layers.

A linear layer keeps, per sequence, its conv state (the last K - 1 inputs of its causal conv,
[C, K - 1] in the model dtype) and its delta-rule state ([Hv, Dk, Dv] float32), whatever the
sequence's length. They live in two static tensors per engine, allocated at load like the KV
cache and indexed by a *slot*:

    conv  [L_lin, S + 1, C, K - 1]      ssm  [L_lin, S + 1, Hv, Dk, Dv]

with S = max_num_seqs; slot S is scratch for padding rows (a decode graph's unused rows read and
write it). A sequence gets a slot at its first chunk (start 0), zeroed then; it keeps it while it
runs and gives it back when it finishes or is preempted (a preempted sequence is recomputed from
token 0, so its state is rebuilt too): slots of sequences no longer running are swept when a new
one needs a slot. Because the state is not paged, a cached KV prefix cannot restore it: prefix
caching is refused for such engines (KVCacheManager.refuse_prefix_caching).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infhip.model_config import ModelConfig
from infhip.runtime.sequence import SequenceStatus


@dataclass
class RecurrentMeta:
    """A step's state slots, in batch order: slots [B] int64 on the device, and its host copy
    (None in a decode graph: every row is a decode row, read by the device tensor)."""

    slots: torch.Tensor
    slots_list: list[int] | None = None


class RecurrentState:
    """The state tensors of one engine and the slot of each running sequence."""

    def __init__(self, cfg: ModelConfig, max_num_seqs: int, dtype: torch.dtype, device: torch.device):
        la = cfg.linear_attention
        self.layers = cfg.linear_layers
        self.row = {layer: i for i, layer in enumerate(self.layers)}  # layer index -> row of the tensors
        n, s = len(self.layers), max_num_seqs + 1
        self.conv = torch.zeros(n, s, la.conv_dim, la.conv_kernel - 1, dtype=dtype, device=device)
        self.ssm = torch.zeros(n, s, la.num_value_heads, la.key_head_dim, la.value_head_dim,
                               dtype=torch.float32, device=device)
        self.scratch = max_num_seqs
        self._held: dict[int, tuple[object, int]] = {}  # seq_id -> (sequence, slot)
        self._free = list(range(max_num_seqs - 1, -1, -1))
        self.device = device

    @staticmethod
    def bytes_for(cfg: ModelConfig, max_num_seqs: int, dtype_bytes: int) -> int:
        """Device bytes the state tensors take (for the memory budget)."""
        la = cfg.linear_attention
        if la is None:
            return 0
        per_seq = la.conv_dim * (la.conv_kernel - 1) * dtype_bytes + la.num_value_heads * la.key_head_dim * la.value_head_dim * 4
        return len(cfg.linear_layers) * (max_num_seqs + 1) * per_seq

    def plan(self, chunks) -> list[int]:
        """The slot of each chunk's sequence (batch order); a sequence's first chunk (start 0)
        gets a zeroed slot."""
        slots = []
        for ch in chunks:
            seq = ch.seq
            held = self._held.get(seq.seq_id)
            if ch.start == 0:
                slot = held[1] if held is not None else self._take()
                self._held[seq.seq_id] = (seq, slot)
                self.conv[:, slot].zero_()
                self.ssm[:, slot].zero_()
            elif held is None:
                raise RuntimeError(f"sequence {seq.seq_id} resumes at token {ch.start} without a recurrent state: "
                                   "linear-attention layers need every token from 0 (no prefix reuse)")
            else:
                slot = held[1]
            slots.append(slot)
        return slots

    def _take(self) -> int:
        if not self._free:
            for seq_id, (seq, slot) in list(self._held.items()):
                if seq.status != SequenceStatus.RUNNING:
                    del self._held[seq_id]
                    self._free.append(slot)
        if not self._free:
            raise RuntimeError(f"more than {self.scratch} sequences hold a recurrent state")
        return self._free.pop()
