"""UniPrefill token drop as a step transform (runtime/step_transform.py, registered under
"token_drop"; what a drop does: infhip/methods/token_drop/runtime/step.py).

Callers set it through the runner by name, ``runner.set_transform("token_drop", cfg)``, and read
it through ``debug_view()`` (``llm.debug_view()["transforms"]["token_drop"]``: the knobs in force,
the drop layers, the tail, the context limit and the retention per request and anchor).

Per-sequence state: the drop histories (per layer, tokens a sequence's layers hold no KV for)
live here, in ``stats`` (DropRecords) by seq_id, not on the sequences: ``release(seq)`` ends one
when the sequence's KV is freed (finished or preempted; the scheduler tells the engine core,
which tells every transform), and a prefill from 0 starts afresh. ``drop_history(seq_id)``
reads one (also of a recently finished sequence: /metrics).

Per step: ``plan`` picks the chunks that drop (plan_drops) and lists the drop histories of the
step's sequences (drop_histories) -> ``TokenDropHost``; ``upload`` makes the step's
``TokenDropStep`` (its drops, and the per-layer KV of the sequences with a history); after an
eager step ``after_step`` records what the drops leave (``stats``, DropRecords). Decode graphs
with drop histories compute the per-layer KV from ``kv_shift`` inside the graph.

The selection of the kept blocks is ``keep_blocks`` (top-p) unless ``set_selection`` installs
another (benchmarks: infhip.eval.common.set_forced_retention; nothing in production does);
``selection`` reads it back (None: top-p).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from infhip.methods.token_drop.knobs import TokenDropConfig, resolve_drop_layers
from infhip.plugins.token_drop import top_p_select
from infhip.runtime.attention.backend import RequestCounter
from infhip.runtime.forward_context import LayerKV
from infhip.runtime.step_transform import StepTransform, TransformEnv, register

from .drop_records import DropRecords
from .step import DropChunk, TokenDropStep, drop_histories, keep_tail, never_drops, plan_drops


@dataclass
class TokenDropHost:
    """Token drop's host meta of one step."""

    drops: list[DropChunk]  # the chunks that drop tokens this step (maybe none)
    # drop histories: [global layer][b] tokens that layer lacks of sequence b's computed ones;
    # None when no sequence of the step has one (every layer then holds every position)
    histories: list[list[int]] | None


@register
class TokenDrop(StepTransform):
    """Token drop of one runner: its knobs (``configure``; None: off, drop histories are still
    honoured), the layers it acts on and the drop statistics of the requests."""

    name = "token_drop"
    prompt_hint = "it would drop tokens of this prompt (UniPrefill): load the engine with token_drop=False"

    def __init__(self, windows: list[int | None], page_size: int, linear: frozenset[int] = frozenset()):
        """windows: each layer's sliding window (None: full attention, or a linear-attention
        layer if in ``linear``: no keys, never an anchor)."""
        self.full = frozenset(i for i, w in enumerate(windows) if w is None and i not in linear)
        self.global_layers = sorted(self.full)  # the layers that hold compacted KV after a drop
        self.windows, self.page_size = windows, page_size
        self.stats = DropRecords()  # drop histories of the sequences (by seq_id), retention per anchor
        self.selection = None  # set_selection's block selection; None: keep_blocks (top-p)
        self._set(None, None)

    @classmethod
    def attach(cls, config) -> "TokenDrop":
        return cls([lp.window for lp in config.plan.layers], config.build.page_size,
                   frozenset(lp.index for lp in config.plan.layers if lp.attention == "linear"))

    def configure(self, cfg: TokenDropConfig | None, env: TransformEnv) -> None:
        """Token drop on (cfg) or off (None) from the next step on. Only requests whose context
        stays within every backend's stored_rotation_context drop: a dropped layer's cache index
        is no longer the key's position (infhip/methods/token_drop/runtime/step.py says why for InfiniteHiP)."""
        if cfg is not None and env.offloading:
            raise ValueError("token drop cannot be turned on while KV pages are offloaded")
        limits = [c for b in env.backends.values() if (c := b.stored_rotation_context(env.config)) is not None]
        self._set(cfg, min(limits, default=None))

    def _set(self, cfg: TokenDropConfig | None, max_context: int | None) -> None:
        drop_at = (frozenset(resolve_drop_layers(cfg, self.global_layers, len(self.windows)))
                   if cfg is not None else frozenset())  # may raise: before anything changes
        self.cfg, self.max_context, self.drop_at = cfg, max_context, drop_at
        self.tail = keep_tail(cfg, self.windows) if cfg is not None else 0

    @staticmethod
    def keep_blocks(scores, cu_blocks, cu_ext, p: float, **kw):
        """The kept blocks of the dropping chunks: top-p (plugins/token_drop/top_p.py)."""
        return top_p_select(scores, cu_blocks, cu_ext, p, **kw)

    def set_selection(self, select) -> None:
        """Benchmarks (nothing in production): from the next step on, choose the kept blocks of the
        dropping chunks with ``select`` (``keep_blocks``' signature and result) instead of top-p;
        None: top-p again. Read back as ``selection``, and by name in ``debug_view()``."""
        self.selection = select

    def keeps_prompt(self, seq) -> bool:
        return never_drops(seq, self.cfg, self.max_context)

    def release(self, seq) -> None:
        self.stats.release(seq)

    def drop_history(self, seq_id: int) -> list[int] | None:
        """Per layer, how many of sequence ``seq_id``'s computed tokens that layer holds no KV for
        (a copy): of a sequence that holds its KV, or of one of the latest finished ones; None:
        it dropped nothing."""
        return self.stats.history(seq_id)

    def request_counters(self) -> list[RequestCounter]:
        """/metrics: finished requests whose prefill dropped tokens, and the KV entries they did not
        write (the sum over layers of a request's drop history, at its finish)."""
        def history(seq) -> list[int]:
            return self.drop_history(seq.seq_id) or []

        return [RequestCounter("infhip_token_drop_requests", "Finished requests whose prefill dropped tokens (UniPrefill)",
                               lambda seq: any(history(seq))),
                RequestCounter("infhip_token_drop_skipped_kv", "Token-layer KV entries not written because the token "
                               "was dropped (sum over layers of the request's drop history, at finish)",
                               lambda seq: sum(history(seq)))]

    def debug_view(self) -> dict:
        """knobs: the TokenDropConfig in force as a dict (None: off); drop_layers: the layers that
        drop (sorted; spared anchors excluded); tail: tokens a dropping chunk always keeps at its
        end; max_context: the longest context a dropping request may reach (None: any);
        retention: {seq_id: {full-attention layer: [kept, total]}} of the latest 256 sequences
        that dropped, oldest first (DropRecords.retention, copied); selection: None (top-p) or the
        repr of the selection set_selection installed."""
        knobs = None
        if self.cfg is not None:
            knobs = dataclasses.asdict(self.cfg)
            if isinstance(knobs["drop_layers"], tuple):
                knobs["drop_layers"] = list(knobs["drop_layers"])
        return {"knobs": knobs, "drop_layers": sorted(self.drop_at), "tail": self.tail,
                "max_context": self.max_context,
                "selection": None if self.selection is None else repr(self.selection),
                "retention": {sid: {layer: list(kt) for layer, kt in per.items()}
                              for sid, per in self.stats.retention.items()}}

    def plan(self, p, chunks) -> TokenDropHost | None:
        drops = plan_drops(chunks, self.cfg, self.tail, self.max_context) if self.cfg is not None else []
        # also ends the histories of fresh prefills
        histories = drop_histories(chunks, self.global_layers, self.stats.histories)
        return TokenDropHost(drops, histories) if drops or histories is not None else None

    def runs_dense(self, host: TokenDropHost) -> bool:
        return bool(host.drops)  # a dropping step runs no sparse attention (token_drop.py)

    def _step(self, drops: list[DropChunk], layer_kv: LayerKV | None) -> TokenDropStep:
        return TokenDropStep(self.cfg, drops, self.full, self.drop_at, self.tail, self.selection or self.keep_blocks,
                             layer_kv)

    def upload(self, host: TokenDropHost, p, ctx) -> TokenDropStep:
        layer_kv = None
        if host.histories is not None:
            layer_kv = LayerKV.of_step(p, host.histories, self.global_layers, ctx.groups["global"].block_tables,
                                       self.page_size, ctx.positions.device)
        return self._step(host.drops, layer_kv)

    def after_step(self, seqs: list, step: TokenDropStep) -> None:
        if step.drops:
            self.stats.record(seqs, step, len(self.windows))

    @property
    def shifts_kv(self) -> bool:
        return self.cfg is not None

    def kv_shift(self, host: TokenDropHost) -> list[list[int]] | None:
        return host.histories

    def graph_step(self, layer_kv: LayerKV) -> TokenDropStep:
        return self._step([], layer_kv)
