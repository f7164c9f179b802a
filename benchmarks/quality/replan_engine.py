"""A copy of an InfiniteHiP engine with another plan and the same weights (hard links): every
layer dense, pruning in one half of the layers or in a range only (layer bisection of retrieval
losses, docs/quality.md), optionally with other special layers (those keep special_final_k in
the last stage).

    python -m benchmarks.quality.replan_engine engines/smol-3k-bf16 engines/smol-dense-bf16 --sparse none
    python -m benchmarks.quality.replan_engine engines/smollm2-135m-3k engines/smollm2-135m-3k-low-only --sparse low
    python -m benchmarks.quality.replan_engine engines/smollm2-135m-3k engines/smol-3k-15-22 --sparse 15-22
    python -m benchmarks.quality.replan_engine engines/smollm2-135m-3k engines/smol-3k-sp --sparse all --special 0,1,2,18,24
    python -m benchmarks.quality.replan_engine engines/q05-3k engines/q05-5k --sparse all --preset 5k
    python -m benchmarks.quality.replan_engine engines/q05-3k engines/q05-5k-8k --sparse all --preset 5k \
        --set 'stages=[[64,64,32768],[64,32,16384],[64,16,8192]]'

--preset applies another InfiniteHiP preset's differences from `3k` (builder/presets.py) and keeps
the rest (dense_threshold, special layers); --set then changes any InfiniteHiP knob, build-time
ones included (KEY=VALUE,... as --infinitehip-overrides). The kernels new stages need are not in
the engine, so a load compiles them (quality runs only, never timings).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from pathlib import Path

from infhip.cli_args import parse_knobs
from infhip.config import EngineConfig
from infhip.methods.infinitehip import PRESET_CHANGES


def replan(src: Path, dst: Path, sparse: str, special: tuple[int, ...] | None = None,
           preset: str | None = None, knobs: dict | None = None) -> None:
    """dst: src's files hard-linked, its config.json with layers outside `sparse` made dense
    ("all": none, "low": pruning in the lower half of the layers only, "high": the upper half,
    "A-B": layers A..B (0-based, inclusive), "none": a dense plan); special: the InfiniteHiP
    special layers (0-based), None = as in src; preset: an InfiniteHiP preset whose changes from
    `3k` replace src's (None = src's knobs); knobs: InfiniteHiP knobs set last."""
    c = EngineConfig.load(src)
    n = len(c.plan.layers)
    lo, hi = {"all": (0, n - 1), "low": (0, n // 2 - 1), "high": (n // 2, n - 1), "none": (n, n)}.get(sparse) or \
        tuple(int(x) for x in sparse.split("-"))
    if not 0 <= lo <= hi <= n:
        raise SystemExit(f"--sparse {sparse}: a layer range inside 0-{n - 1} is needed")
    layers = tuple(lp if lo <= lp.index <= hi and lp.backend == "infinitehip" else dataclasses.replace(lp, backend="dense")
                   for lp in c.plan.layers)
    ih = c.plan.knobs_of("infinitehip")
    changes: dict = {"preset": "dense"} if sparse == "none" else {}
    if sparse == "none":
        ih = None
    elif special is not None or preset is not None or knobs:
        ih = ih.replace(**PRESET_CHANGES[preset]) if preset else ih
        ih = ih.replace(special_layers=special) if special is not None else ih
        ih = ih.replace(**knobs) if knobs else ih
        if preset:
            changes["preset"] = preset
    # one replace: the plan validates that it holds InfiniteHiP knobs exactly when a layer runs it,
    # so layers and knobs change together (a plan between the two steps would be refused)
    knobs = {k: v for k, v in c.plan.knobs.items() if k != "infinitehip"} | ({"infinitehip": ih} if ih else {})
    config = dataclasses.replace(c, plan=dataclasses.replace(c.plan, layers=layers, knobs=knobs, **changes))
    shutil.copytree(src, dst, copy_function=lambda a, b: Path(b).hardlink_to(a))
    try:
        (dst / "config.json").unlink()  # a hard link: write a new file, not through the source's
        config.save(dst)
    except BaseException:
        shutil.rmtree(dst)  # no half-written engine
        raise


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--sparse", required=True,
                    help="which layers keep their InfiniteHiP plugin: all | low | high | none | A-B (0-based)")
    ap.add_argument("--special", help="special layers, 0-based, comma-separated (default: as in src)")
    ap.add_argument("--preset", choices=sorted(PRESET_CHANGES), help="another InfiniteHiP preset's stages and "
                    "refresh intervals (default: as in src)")
    ap.add_argument("--set", default="", help="InfiniteHiP knobs, KEY=VALUE,... (values as JSON), build-time "
                    "ones included; applied after --preset and --special")
    args = ap.parse_args()
    if args.dst.exists():
        raise SystemExit(f"{args.dst} exists; remove it first")
    special = tuple(int(x) for x in args.special.split(",")) if args.special else None
    replan(args.src, args.dst, args.sparse, special, args.preset, parse_knobs(args.set))
    plugins = "".join("s" if lp.backend == "infinitehip" else "d" for lp in EngineConfig.load(args.dst).plan.layers)
    print(f"{args.dst}: layers {plugins} (s: infinitehip, d: dense)")


if __name__ == "__main__":
    main()
