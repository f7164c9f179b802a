"""InfiniteHiP (paper 000), an attention backend: everything of the method starts here.

    __init__.py   its declaration (:class:`InfiniteHip`, registered on import): presets, the layers
                  it runs, its runtime module, the plugin modules whose kernels it launches, what it
                  tells offload and the compile matrix
    knobs.py      its knobs (:class:`InfiniteHipConfig`, ``plan.knobs["infinitehip"]``) and presets
    rules.py      plan rules its runtime planner and its kernels' launch space both apply
    runtime/      the attention backend (backend.py there; planner, mask cache, one layer's run)
    plugins/infinitehip/   its Triton kernels, torch references and AOT launch space (_aot.py),
                  named by ``plugin_modules``

Layering: ``__init__.py``, knobs.py and rules.py are the engine format's side, torch-free (the
builder and the runtime both read them); ``runtime/`` is the runtime's side and imports the
runtime (tests/test_layers.py holds both). Its quality references (recall of the final masks)
are eval/recall.py.

    >>> from infhip.methods import method
    >>> method("infinitehip").presets["3k-fast"]
    {'refresh_intervals': (32, 16, 8)}
"""

from __future__ import annotations

from typing import Any

from infhip.methods.method import BACKEND, Method, register, require

from .knobs import (CHUNK_SCORES, PRESET_CHANGES, RUNTIME_KNOBS, InfiniteHipConfig, PruningStage,
                    infinitehip_config)
from .rules import fitting_query_strides, sparse_reachable

# one layer at 1M keys, decode vs SDPA, per preset (docs/benchmarks.md): docs/knobs.md's preset table
PRESET_MEASURED = {"3k": "28.8× with the bank (`e913143`)", "3k-fast": "31.7× without the bank (`4e4b22f`)",
                   "3k-flash": "45.6× with the bank (run H)", "5k": "8.9× without the bank (`e895854`)"}


@register
class InfiniteHip(Method):
    """InfiniteHiP (paper 000) on the full-attention layers: hierarchical chunk pruning, then
    block-sparse attention over sink + survivors + stream; dynamic RoPE past the trained window."""

    name = "infinitehip"
    kind = BACKEND
    knobs = InfiniteHipConfig
    title = "InfiniteHiP"
    knobs_doc = ("`InfiniteHipConfig` in `infhip/methods/infinitehip/knobs.py`, stored under `plan.knobs.infinitehip`. "
                 "Its defaults are preset `3k`; \"=\" where another preset keeps the `3k` value. `dense_threshold` as "
                 "built is at most the trained window + 1. *load* = may be changed per `LLM(..., "
                 "infinitehip_overrides=...)` / `--infinitehip-overrides`; *build* needs a rebuild.")
    preset_measured = PRESET_MEASURED
    summary = ("InfiniteHiP on the full-attention layers (hierarchical chunk pruning + block-sparse attention, "
               "dynamic RoPE past the trained window)")
    runtime_module = "infhip.methods.infinitehip.runtime.backend"
    plugin_modules = ("infhip.plugins.infinitehip.pruning", "infhip.plugins.infinitehip.sparse_attention",
                      "infhip.plugins.infinitehip.key_bank", "infhip.plugins.infinitehip.raw_keys")
    presets = PRESET_CHANGES
    # 3k-fast and 3k-flash differ from 3k in refresh intervals only, which no kernel specializes on
    # (tests/test_compile_matrix.py holds that): 3k stands for them in the compile matrix
    matrix_presets = ("3k", "5k")
    build_hint = "rebuild with --preset 3k (or another InfiniteHiP preset)"
    renamed_flags = {"--infinitehip": "use --infinitehip-overrides KEY=VALUE,..."}

    @classmethod
    def presets_doc(cls) -> str:
        base = InfiniteHipConfig()
        return (f"Every InfiniteHiP preset: stages are (block_q, chunk size, k kept); sink {base.n_sink}, stream "
                f"{base.n_stream}, query blocks of {base.block_q}, special layers "
                f"{', '.join(map(str, base.special_layers))} (0-based) keeping {base.special_final_k} keys in the "
                f"last stage, prefill query strides {', '.join(map(str, base.query_strides))}, key bank on.")

    @classmethod
    def preset_knobs(cls, preset: str, model, changes: dict[str, Any] | None = None) -> InfiniteHipConfig:
        """The preset's knobs, ``dense_threshold`` capped at the model's trained window + 1,
        special layers within the model, and (unless given) query strides whose SelectRep query
        tiles fit a GPU's shared memory (rules.fitting_query_strides)."""
        cfg = infinitehip_config(preset, changes, trained_window=model.max_position_embeddings)
        past = [i for i in cfg.special_layers if i >= model.num_layers]
        require(not past, f"special_layers {past} are past the model's {model.num_layers} layers "
                f"(0-based indices, 0..{model.num_layers - 1})")
        if "query_strides" not in (changes or {}):
            cfg = cfg.replace(query_strides=fitting_query_strides(cfg, model.num_heads // model.num_kv_heads,
                                                                  model.head_dim))
        return cfg

    @classmethod
    def moves_pages(cls, knobs: InfiniteHipConfig, build) -> bool:
        """Pages move once a context reaches the dense threshold (rules.sparse_reachable)."""
        return sparse_reachable(knobs, build.max_seq_len)


__all__ = ["CHUNK_SCORES", "PRESET_CHANGES", "RUNTIME_KNOBS", "InfiniteHip", "InfiniteHipConfig", "PruningStage",
           "infinitehip_config"]
