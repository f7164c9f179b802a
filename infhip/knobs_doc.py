"""docs/knobs.md, generated from the knobs' field metadata (infhip/knobs.py, runtime/options.py).

    python -m infhip.knobs_doc > docs/knobs.md

tests/test_knobs.py fails when docs/knobs.md differs from :func:`markdown`.
"""

from __future__ import annotations

import dataclasses
import re
import sys


def _value(v) -> str:
    from infhip.knobs import PruningStage

    if isinstance(v, PruningStage):
        return f"({v.block_q}, {v.chunk_size}, {v.k})"
    if isinstance(v, tuple):
        return ", ".join(_value(x) for x in v)
    if isinstance(v, bool):
        return "on" if v else "off"
    return "—" if v is None else str(v)


def _links(text: str) -> str:
    """docs/X.md -> a link relative to docs/ (this file's folder)."""
    return re.sub(r"\bdocs/([\w./-]+\.md)", r"[docs/\1](\1)", text)


def _row(cells) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def _section(title: str, intro: str, head: list[str], rows: list[list]) -> list[str]:
    return [f"## {title}", "", intro, "", _row(head), _row(["---"] * len(head))] + [_row(r) for r in rows]


def _infinitehip() -> list[str]:
    from infhip.builder.presets import PRESET_CHANGES, infinitehip_config
    from infhip.knobs import InfiniteHipConfig

    presets = list(PRESET_CHANGES)
    configs = {p: infinitehip_config(p) for p in presets}
    rows = []
    for f in dataclasses.fields(InfiniteHipConfig):
        base = getattr(configs["3k"], f.name)
        cells = [_value(base)] + ["=" if getattr(configs[p], f.name) == base else _value(getattr(configs[p], f.name))
                                  for p in presets[1:]]
        rows.append([f"`{f.name}`"] + cells + ["load" if f.metadata["runtime"] else "build", f.metadata["doc"],
                                               _links(f.metadata["measured"])])
    intro = ("Every layer with the `infinitehip` plugin (the full-attention layers of an engine built with "
             "`infhip-build --preset 3k | 3k-fast | 3k-flash | 5k`). `InfiniteHipConfig()` is preset `3k`; "
             "the other presets differ where a value is shown (builder/presets.py `PRESET_CHANGES`). Change any "
             "knob at build with `--infinitehip-overrides KEY=VALUE,...`; those marked *load* also per load "
             "(`LLM(engine, infinitehip_overrides={...})`, `--infinitehip-overrides` of infhip-run / "
             "infhip-serve / infhip-eval).")
    head = ["knob"] + [f"{p} (default)" if p == "3k" else p for p in presets] + ["changed at", "meaning", "measured"]
    return _section("InfiniteHiP (`plan.infinitehip`)", intro, head, rows) + [
        "", "`dense_threshold` as built is at most the model's trained window + 1 (a context past the window "
        "always runs sparse, with InfiniteHiP's dynamic RoPE)."]


def _token_drop() -> list[str]:
    from infhip.knobs import RENAMED_TOKEN_DROP_KNOBS, TokenDropConfig

    rows = [[f"`{f.name}`", _value(f.default), "load" if f.metadata["runtime"] else "build", f.metadata["doc"],
             _links(f.metadata["measured"])] for f in dataclasses.fields(TokenDropConfig)]
    intro = ("Off unless built with `infhip-build --token-drop [KEY=VALUE,...]` or loaded with "
             "`LLM(engine, token_drop=True | {...})` / `--token-drop on | KEY=VALUE,...`; every knob may be "
             "changed per load (laid over the engine's).")
    old = ", ".join(f"`{k}` → `{v}`" for k, v in RENAMED_TOKEN_DROP_KNOBS.items())
    return _section("UniPrefill token drop (`plan.token_drop`)", intro,
                    ["knob", "default", "changed at", "meaning", "measured"], rows) + [
        "", f"One name per knob: the short names once accepted ({old}) are errors that name the field. "
        "`retention` (`rho`), a fixed share of blocks kept instead of top-p, is a benchmark setting, not "
        "a knob: `infhip-eval --retention RHO`, `infhip.eval.common.set_forced_retention(llm, rho)`; "
        "engines whose config.json names it load without it."]


def _load_options() -> list[str]:
    from infhip.runtime.options import LoadOptions, flag_of

    rows = [[f"`{f.name}`", f"`{flag_of(f.name)}`", _value(f.default), f.metadata["doc"]]
            for f in dataclasses.fields(LoadOptions)]
    intro = ("One typed object, `LoadOptions` (runtime/options.py): `LLM(engine, LoadOptions(...))` or its "
             "fields as keywords; the commands' flags have the same names. Sizes take bytes or binary units "
             "(`16GiB`, `512MiB`).")
    return _section("Load options (`LLM(engine, ...)`, infhip-run, infhip-serve, infhip-eval)", intro,
                    ["option", "flag", "default", "meaning"], rows)


def _constants() -> list[str]:
    from infhip.runtime import model_runner, sparse_attention

    rows = [["`RAW_KEYS_MIN_BLOCKS` (runtime/sparse_attention.py)", sparse_attention.RAW_KEYS_MIN_BLOCKS,
             "dynamic-RoPE prefill steps with at least this many sparse query blocks prune from un-rotated keys",
             "benchmarks/bench_constants.py (raw keys vs rotating, per query-block count)"],
            ["`OFFLOAD_BATCH_TOKENS` (runtime/model_runner.py)", model_runner.OFFLOAD_BATCH_TOKENS,
             "KV offloading moves a request's pages once this many tokens' pages are eligible",
             "benchmarks/bench_constants.py (page copies per batch size, amortized per decode step)"]]
    return _section("Constants in the code (not knobs, not measured yet)",
                    "Set without a measurement; the benchmark named decides them on the GPU.",
                    ["constant", "value", "what it decides", "measured by"], rows)


def _older_engines() -> list[str]:
    return ["## Engines built before a knob existed", "",
            "They load with the value they ran with: no `query_strides` = 1 per stage (the paper's formula), no "
            "`key_bank` = off, no `spare_anchors` = 0; removed knobs in their config.json (`solo_last_query`, "
            "token drop's `retention`) are ignored."]


def markdown() -> str:
    parts = [["# Knobs", "",
              "Generated by `python -m infhip.knobs_doc > docs/knobs.md` from the knobs' field metadata "
              "(infhip/knobs.py, runtime/options.py); tests/test_knobs.py fails when this file is out of date. "
              "*load*: a load may change the knob (no rebuild); *build*: only `infhip-build` sets it."],
             _infinitehip(), _token_drop(), _load_options(), _older_engines(), _constants()]
    return "\n\n".join("\n".join(p) for p in parts) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
