"""InfiniteHiP's knobs (:class:`InfiniteHipConfig`, stored under ``plan.knobs["infinitehip"]``) and
its presets; the method's declaration is this folder's ``__init__.py``.

Each knob is a dataclass field whose metadata is its one description (:func:`knob`): meaning,
whether a load may change it (``runtime``), and the measurement behind its value. From it come
:data:`RUNTIME_KNOBS` (what ``LLM(..., infinitehip_overrides=...)`` may change) and
docs/knobs.md (``python -m infhip.knobs_doc > docs/knobs.md``; a test keeps it in sync). The
dataclass defaults are preset ``3k``; :data:`PRESET_CHANGES` writes the other presets as differences.

Presets (SPEC §4, §6; sliding-window layers always stay dense: their window already bounds the work):

    3k         the knobs' defaults: stages (64, 256, 32K) -> (64, 32, 8K) -> (64, 8, 2048), final k
               4096 in layers 1-3 (1-based), refresh every (16, 8, 4) steps, prefill query strides
               (4, 4, 1), past the trained window a rotated key bank for the cached decode steps
    3k-fast    3k with refresh (32, 16, 8)
    3k-flash   3k with refresh (96, 24, 8)
    5k         3k with chunks 64 / 32 / 16, k 32K / 16K / 4096

    >>> infinitehip_config("3k-fast").refresh_intervals
    (32, 16, 8)
    >>> infinitehip_config("5k").stages[-1]
    PruningStage(block_q=64, chunk_size=16, k=4096)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from infhip.methods.method import NOT_MEASURED, knob, require


PRUNING_ROPE_STYLES = ("none", "relative", "chunk_indexed")
ATTENTION_ROPE_STYLES = ("none", "streaming")


@dataclass(frozen=True)
class PruningStage:
    """One InfiniteHiP pruning stage (SPEC §4): query blocks of ``block_q`` queries, candidate
    chunks of ``chunk_size`` keys (a power of two), keep ``k`` keys (k / chunk_size chunks)."""

    block_q: int
    chunk_size: int
    k: int

    def __post_init__(self) -> None:
        require(self.block_q > 0, f"block_q must be positive, got {self.block_q}")
        require(self.chunk_size > 0 and self.chunk_size & (self.chunk_size - 1) == 0,
               f"chunk_size must be a power of two, got {self.chunk_size}")
        require(self.k > 0 and self.k % self.chunk_size == 0,
               f"k ({self.k}) must be a positive multiple of chunk_size ({self.chunk_size})")


CHUNK_SCORES = ("max", "head_normalized")
# Knobs that engines built earlier may still name; loading ignores them. solo_last_query (the
# sampled prefill query scored its own mask): measured no gain on the H200 (SmolLM2 passkey +
# NIAH 23 vs 22 right of 81), always off in the presets — removed.
REMOVED_INFINITEHIP_KNOBS = frozenset({"solo_last_query"})


_ONE_LAYER = "[one layer](benchmarks.md#decode-infinitehip-one-layer-vs-sdpa)"
_WHOLE_MODEL = "[whole model](benchmarks.md#decode-infinitehip-whole-model-vs-the-dense-engine)"


@dataclass(frozen=True)
class InfiniteHipConfig:
    """Knobs of every "infinitehip" layer of an engine (paper 000). The defaults are preset
    ``3k``; the other presets are differences from it (:data:`PRESET_CHANGES`).

    A request whose context (after the step) is below ``dense_threshold`` runs dense attention;
    at or above it, each query block goes through ``stages`` then block-sparse attention over
    sink [0, n_sink) + the last stage's survivors + the newest ``n_stream`` tokens. Layers in
    ``special_layers`` (0-based) keep ``special_final_k`` keys in the last stage and prune with
    ``special_pruning_rope``. In decode, stage i is recomputed every ``refresh_intervals[i]``
    steps of a request (mask caching); each interval must be a multiple of the next, so a stage's
    refresh always comes with the later stages'. In prefill, stage i scores a query block's
    chunks with every ``query_strides[i]``-th of its queries only (1 = the paper's formula):
    ~1/s of the stage's work, the mask still shared by the whole block
    (plugins/infinitehip/pruning.py). ``chunk_score`` "head_normalized" subtracts, per kv head,
    that head's best chunk score before the max, so a head with small logits (e.g. a retrieval
    head) still keeps its best chunks. ``key_bank`` (streaming attention RoPE): each refresh of
    the last stage rotates its keys once into a per-request bank that the cached decode steps
    read (plugins/infinitehip/key_bank.py; memory: (min(max_num_seqs, key_bank_slots) + 1) x
    layers x final k x kv heads x head_dim in the KV dtype, about 1.2 GiB for Llama-8B with 8 + 1
    rows, reserved only when max_seq_len exceeds the trained window); a decode step whose
    request owns no bank row (infhip/methods/infinitehip/runtime/mask_cache.py) rotates keys instead:
    the same tokens, slower.
    """

    n_sink: int = knob(256, "first tokens every query attends (attention sinks)", measured=NOT_MEASURED)
    n_stream: int = knob(1024, "newest tokens every query attends", measured=NOT_MEASURED)
    stages: tuple[PruningStage, ...] = knob(
        (PruningStage(64, 256, 32768), PruningStage(64, 32, 8192), PruningStage(64, 8, 2048)),
        "pruning stages: query block, chunk size, keys kept", measured=_ONE_LAYER + "; retrieval vs dense: "
        "[quality](quality.md#smollm2-135m-3k-vs-dense-4k32k-h200)")
    refresh_intervals: tuple[int, ...] = knob(
        (16, 8, 4), "decode steps between recomputations of stage i (each a multiple of the next)", runtime=True,
        measured=f"{_ONE_LAYER}, {_WHOLE_MODEL}")
    query_strides: tuple[int, ...] = knob(
        (4, 4, 1), "prefill: stage i scores a block's chunks with every s-th query (1 = the paper's formula; "
        "4, 4, 1 = the paper's public code); a preset doubles a stage's stride where its query tile would not fit "
        "shared memory under relative pruning RoPE (GQA 7-8 at head_dim 128, 4 at 256: 4, 4, 2)", runtime=True,
        measured="1M prefill: 1,1,1 6.0×, 4,4,1 19.9×, 4,4,4 25.6× SDPA "
        "([benchmarks](benchmarks.md#prefill-infinitehip-one-layer-vs-sdpa)). SmolLM2 retrieval: 24 / 23 / 21 of "
        "81 prompts for 1,1,1 / 4,4,1 / 4,4,4, perplexity equal; NIAH 51 (4,4,1) vs 49 (4,4,4) of 90 "
        "([quality](quality.md#query-strides-and-stage-3-at-stride-4))")
    special_layers: tuple[int, ...] = knob(
        (0, 1, 2), "0-based layers that keep `special_final_k` and prune with `special_pruning_rope`",
        measured="Qwen2.5-0.5B `3k` with 0–3, 9, 11, 16, 22: recall 0.913 → 0.917 at 8K–32K, RULER NIAH 32K "
        "81 vs 75, 128K equal ([quality](quality.md#budgets-and-knobs-on-qwen25-coder-05b)); "
        "`infhip-eval recall` lists candidates ([quality](quality.md#attention-recall-of-the-final-masks))")
    special_final_k: int = knob(
        4096, "last-stage keys kept in the special layers", measured="Qwen2.5-0.5B `5k`, 4096 → 16384: recall at "
        "8K–32K 0.933 → 0.945, RULER NIAH and passkey equal within noise; speed not measured "
        "([quality](quality.md#budgets-and-knobs-on-qwen25-coder-05b))")
    # n_sink + n_stream + stages[0].k; a preset caps it at the trained window + 1 (InfiniteHip.preset_knobs)
    dense_threshold: int = knob(
        256 + 1024 + 32768, "a request runs dense attention until its context reaches this (as built: "
        "min(n_sink + n_stream + stage-1 k, trained window + 1))", runtime=True,
        measured="derived: below it stage 1 keeps every candidate; past the trained window dense attention "
        "fails (SmolLM2, [quality](quality.md#smollm2-135m-3k-vs-dense-4k32k-h200))")
    pruning_rope: str = knob(
        "relative", "RoPE style of the pruning stages past the window (`none`, `relative`, `chunk_indexed`)",
        measured="Qwen2.5-0.5B `5k` at 128K, RULER NIAH: `relative` 72.5, `chunk_indexed` 65.0, `none` 22.5 "
        "(n = 20; [quality](quality.md#budgets-and-knobs-on-qwen25-coder-05b))")
    special_pruning_rope: str = knob("chunk_indexed", "the same for the special layers", measured=NOT_MEASURED)
    attention_rope: str = knob("streaming", "RoPE style of the block-sparse attention (`none`, `streaming`)",
                               measured=NOT_MEASURED)
    rope_off_in_trained_window: bool = knob(
        True, "dynamic RoPE only once a context passes the trained window", runtime=True,
        measured="the dynamic-RoPE cost it avoids inside the window, 1M keys: cached-step attention 23.5 µs "
        "rotating vs 12.6 µs unrotated, decode stage 1 212 vs 58 µs ([history](results/history/benchmarks.md), "
        "\"Fourth measurement\"); its quality effect is not measured")
    stagger_refresh: bool = knob(
        True, "shift each layer's refresh phase so no step pays every refresh", runtime=True,
        measured="whole model P99/median: 1.01–1.09 staggered vs 1.82 (128K) and 2.76 (512K) synchronized "
        f"({_WHOLE_MODEL})")
    chunk_score: str = knob(
        "head_normalized", "`max`: the paper's max over heads and queries; `head_normalized`: per kv head "
        "minus that head's best chunk score first", runtime=True,
        measured="`head_normalized` better or equal in every SmolLM2 passkey/NIAH cell on the H200 (e.g. NIAH "
        "32K 0.444 → 0.667), recall unchanged ([quality](quality.md#chunk_score-max-vs-head_normalized-smollm2-h200)); "
        "Qwen2.5-0.5B RULER NIAH at 32K 75 vs 60 (`3k`), 82.5 vs 75 (`5k`), equal within noise at 128K "
        "([quality](quality.md#budgets-and-knobs-on-qwen25-coder-05b)); decode at 512K 5.72 vs 5.74 ms a step "
        "([benchmarks](benchmarks.md#decode-infinitehip-whole-model-vs-the-dense-engine), run E)")
    key_bank: bool = knob(
        True, "past the window, a last-stage refresh rotates its keys once into a per-request bank that "
        "cached decode steps read", runtime=True,
        measured="1M keys, one layer: `3k-flash` 45.6× SDPA with, 34.1× without (run H); whole model 512K: 166.4 vs "
        f"155.6 tok/s ({_WHOLE_MODEL}). Memory: 4 MiB per row and layer for Llama-8B, about 1.2 GiB for "
        "8 + 1 rows, reserved only when max_seq_len passes the window")
    key_bank_slots: int = knob(
        8, "decoding requests that own a bank row (rows: min(max_num_seqs, this) + 1); a step with a row "
        "that owns none rotates keys instead (same tokens, slower)", runtime=True, measured="not measured")

    def __post_init__(self) -> None:
        require(self.n_sink >= 0 and self.n_stream > 0, "n_sink must be >= 0 and n_stream > 0")
        require(len(self.stages) > 0, "at least one pruning stage")
        require(len(self.refresh_intervals) == len(self.stages),
               f"{len(self.refresh_intervals)} refresh intervals for {len(self.stages)} stages")
        require(all(n > 0 for n in self.refresh_intervals), "refresh intervals must be positive")
        require(len(self.query_strides) == len(self.stages),
               f"{len(self.query_strides)} query strides for {len(self.stages)} stages")
        require(all(1 <= s <= self.stages[0].block_q for s in self.query_strides),
               f"query strides must be in [1, block_q={self.stages[0].block_q}], got {self.query_strides}")
        for a, b in zip(self.refresh_intervals, self.refresh_intervals[1:]):
            require(a % b == 0, f"refresh interval {a} is not a multiple of the next stage's {b}: a "
                   "stage's refresh must imply the later stages' refresh")
        require(len({s.block_q for s in self.stages}) == 1, "all stages share one block_q")
        require(self.n_stream >= self.stages[0].block_q, "n_stream must be >= block_q (a query sees itself)")
        for a, b in zip(self.stages, self.stages[1:]):
            require(b.k <= a.k, f"stage k must not grow: {a.k} then {b.k}")
        last = self.stages[-1]
        prev_k = self.stages[-2].k if len(self.stages) > 1 else None
        require(self.special_final_k % last.chunk_size == 0 and self.special_final_k > 0,
               f"special_final_k {self.special_final_k} must be a positive multiple of {last.chunk_size}")
        require(prev_k is None or self.special_final_k <= prev_k,
               f"special_final_k {self.special_final_k} exceeds the previous stage's k {prev_k}")
        require(all(i >= 0 for i in self.special_layers), "special_layers are 0-based layer indices")
        require(self.dense_threshold >= 1, "dense_threshold must be >= 1")
        require(self.pruning_rope in PRUNING_ROPE_STYLES and self.special_pruning_rope in PRUNING_ROPE_STYLES,
               f"pruning RoPE styles must be in {PRUNING_ROPE_STYLES}")
        require(self.attention_rope in ATTENTION_ROPE_STYLES,
               f"attention_rope must be in {ATTENTION_ROPE_STYLES}")
        require(self.chunk_score in CHUNK_SCORES, f"chunk_score must be one of {CHUNK_SCORES}")
        require(isinstance(self.key_bank_slots, int) and not isinstance(self.key_bank_slots, bool)
               and self.key_bank_slots >= 1, f"key_bank_slots must be an integer >= 1, got {self.key_bank_slots!r}")
        for name in ("rope_off_in_trained_window", "stagger_refresh", "key_bank"):
            value = getattr(self, name)
            require(isinstance(value, bool), f"{name} must be true or false, got {value!r}")

    @property
    def block_q(self) -> int:
        return self.stages[0].block_q

    def stages_of(self, layer: int) -> tuple[PruningStage, ...]:
        """The stages of one layer: the special layers keep special_final_k in the last one."""
        if layer not in self.special_layers:
            return self.stages
        last = self.stages[-1]
        return self.stages[:-1] + (PruningStage(last.block_q, last.chunk_size, self.special_final_k),)

    def pruning_rope_of(self, layer: int) -> str:
        return self.special_pruning_rope if layer in self.special_layers else self.pruning_rope

    def replace(self, **overrides: Any) -> "InfiniteHipConfig":
        """A validated copy with some knobs changed (lists accepted for tuple fields)."""
        unknown = set(overrides) - {f.name for f in dataclasses.fields(self)}
        require(not unknown, f"unknown InfiniteHiP knob(s): {', '.join(sorted(unknown))}")
        fixed = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
        if "stages" in fixed:
            fixed["stages"] = tuple(s if isinstance(s, PruningStage) else PruningStage(*s)
                                    for s in fixed["stages"])
            if "query_strides" not in fixed and len(fixed["stages"]) != len(self.query_strides):
                fixed["query_strides"] = (1,) * len(fixed["stages"])  # other stage count: exact
        return dataclasses.replace(self, **fixed)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "InfiniteHipConfig":
        d = {k: v for k, v in d.items() if k not in REMOVED_INFINITEHIP_KNOBS}  # older engines
        d["stages"] = tuple(PruningStage(**s) for s in d["stages"])
        # Engines built before a knob existed ran without it: absent query_strides = all 1 (the
        # paper's formula), absent key_bank = off; the other knobs' defaults are what they ran.
        d.setdefault("query_strides", (1,) * len(d["stages"]))
        d.setdefault("key_bank", False)
        for key in ("refresh_intervals", "special_layers", "query_strides"):
            if key in d:
                d[key] = tuple(d[key])
        return cls(**d)


# InfiniteHiP knobs a load may change (``LLM(..., infinitehip_overrides=...)``): they change
# speed or accuracy, never the meaning of the weights or the stored plan's shapes.
RUNTIME_KNOBS = tuple(f.name for f in dataclasses.fields(InfiniteHipConfig) if f.metadata["runtime"])

# Each preset as its differences from InfiniteHipConfig() (= 3k). Refresh intervals:
# docs/benchmarks.md (decode amortized over the refresh cycle; 3k-flash, the fastest, keeps
# passkey / NIAH on SmolLM2: docs/quality.md).
PRESET_CHANGES: dict[str, dict[str, Any]] = {
    "3k": {},
    "3k-fast": {"refresh_intervals": (32, 16, 8)},
    "3k-flash": {"refresh_intervals": (96, 24, 8)},
    "5k": {"stages": ((64, 64, 32768), (64, 32, 16384), (64, 16, 4096))},
}


def infinitehip_config(preset: str, overrides: dict[str, Any] | None = None,
                       trained_window: int | None = None) -> InfiniteHipConfig:
    """The knobs of an InfiniteHiP preset, with ``overrides`` applied (validated).

    ``dense_threshold`` (unless overridden) is n_sink + n_stream + stage-1 k of the result: below
    that context stage 1 keeps every candidate, so pruning only narrows the later stages and
    dense attention over that few keys (≤ 34K) is both exact and fast enough — but never above
    ``trained_window`` + 1 (a request goes sparse once its context reaches the threshold): a
    context that fills the trained window exactly stays dense, and the first token past it goes
    sparse, where dense attention would see positions the model was not trained on and fail
    (SmolLM2's 8K); that is what InfiniteHiP's dynamic RoPE is for."""
    if preset not in PRESET_CHANGES:
        raise ValueError(f"{preset!r} is not an InfiniteHiP preset; those are: {', '.join(PRESET_CHANGES)}")
    overrides = dict(overrides or {})
    cfg = InfiniteHipConfig().replace(**{**PRESET_CHANGES[preset], **overrides})
    if "dense_threshold" in overrides:
        return cfg
    cap = trained_window + 1 if trained_window else 1 << 62  # contexts <= the window stay dense
    return cfg.replace(dense_threshold=min(cap, cfg.n_sink + cfg.n_stream + cfg.stages[0].k))


__all__ = ["CHUNK_SCORES", "PRESET_CHANGES", "RUNTIME_KNOBS", "InfiniteHipConfig", "PruningStage",
           "infinitehip_config"]
