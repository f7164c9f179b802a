"""UniPrefill token drop (paper 004), a step transform: everything of the method starts here.

    __init__.py   its declaration (:class:`TokenDrop`, registered on import): its command-line form,
                  its check against a plan, its runtime module, the plugin modules whose kernels it
                  launches
    knobs.py      its knobs (:class:`TokenDropConfig`, ``plan.knobs["token_drop"]``), the drop-layer
                  schedule (``resolve_drop_layers``) and the ``--token-drop KEY=VALUE,...`` parser
    runtime/      the step transform (transform.py there), what one step's drops do (step.py)
                  and what they leave per sequence (drop_records.py)
    plugins/token_drop/   its Triton kernels, torch references and AOT launches, named by
                  ``plugin_modules``

Layering: ``__init__.py`` and knobs.py are the engine format's side, torch-free (the builder and
the runtime both read them); ``runtime/`` is the runtime's side (tests/test_layers.py holds both).
Its quality references are eval/token_drop_reference.py (the paper's algorithm in float64)
and eval/hybrid_reference.py (Qwen3-Next).

    --token-drop                                     the defaults
    --token-drop drop_layers=5:8:11,reenter=true     layer lists joined by ':' (commas split knobs)
    --token-drop off | on                            (at load) off, or as built / the defaults

    >>> TokenDrop.build_knobs("p=0.98,block_size=32").block_size
    32
"""

from __future__ import annotations

from typing import Any

from infhip.methods.method import TRANSFORM, Method, register, require

from .knobs import (AUTHORS_LLAMA_EIGHTHS, DROP_POINTS, RENAMED_TOKEN_DROP_KNOBS, TokenDropConfig,
                    check_token_drop_keys, default_drop_layers, parse_token_drop, parse_token_drop_knobs,
                    resolve_drop_layers)


@register
class TokenDrop(Method):
    """UniPrefill token dropping in prefill at full-attention layers (paper 004)."""

    name = "token_drop"
    kind = TRANSFORM
    knobs = TokenDropConfig
    title = "Token-drop"
    knobs_doc = ("`TokenDropConfig` in `infhip/methods/token_drop/knobs.py`, stored under `plan.knobs.token_drop` (absent = "
                 "off). Set with `--token-drop KEY=VALUE,...` or per load `LLM(engine, token_drop={...})` (`False` "
                 "turns it off); every knob may be changed per load. Engines with InfiniteHiP layers drop only for "
                 "requests whose prompt + max_tokens stay inside the trained window. The short keys once accepted ("
                 + ", ".join(f"`{k}`" for k in RENAMED_TOKEN_DROP_KNOBS) + ", `rho`) are errors that name the field. "
                 "`retention` (a fixed share of blocks kept instead of top-p) is a benchmark setting, not a knob: "
                 "`infhip-eval --retention RHO`, `infhip.eval.common.set_forced_retention(llm, rho)`.")
    summary = ("UniPrefill token dropping in prefill at the full-attention layers: bare for the defaults, or "
               "key=value,... with the knobs' names (e.g. p=0.98,block_size=32 or drop_layers=5:8:11); "
               "composes with --preset")
    runtime_module = "infhip.methods.token_drop.runtime.transform"
    plugin_modules = ("infhip.plugins.token_drop.importance", "infhip.plugins.token_drop.top_p",
                      "infhip.plugins.token_drop.attention", "infhip.plugins.token_drop.gather",
                      "infhip.plugins.token_drop.anchors")
    build_hint = "rebuild with --token-drop"

    @classmethod
    def parse(cls, text: str) -> dict[str, Any]:
        return parse_token_drop_knobs(text)

    @classmethod
    def check(cls, knobs: TokenDropConfig, plan) -> None:
        """Drops need a full-attention layer, and an explicit drop_layers list names such layers."""
        full = [lp.index for lp in plan.layers if lp.window is None and lp.attention != "linear"]
        require(bool(full), "--token-drop needs full-attention layers (its anchors); this model has none")
        resolve_drop_layers(knobs, full, len(plan.layers))




__all__ = ["AUTHORS_LLAMA_EIGHTHS", "DROP_POINTS", "TokenDrop", "TokenDropConfig", "check_token_drop_keys",
           "default_drop_layers", "parse_token_drop", "parse_token_drop_knobs", "resolve_drop_layers"]
