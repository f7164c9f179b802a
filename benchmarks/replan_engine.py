"""A copy of an InfiniteHiP engine with another plan and the same weights (hard links): every
layer dense, or pruning in one half of the layers only (layer bisection of retrieval losses,
docs/quality.md).

    python benchmarks/replan_engine.py engines/smol-3k-bf16 engines/smol-dense-bf16 --sparse none
    python benchmarks/replan_engine.py engines/smollm2-135m-3k engines/smollm2-135m-3k-low-only --sparse low
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from pathlib import Path

from infhip.config import EngineConfig


def replan(src: Path, dst: Path, sparse: str) -> None:
    """dst: src's files hard-linked, its config.json with layers outside `sparse` made dense
    ("low": pruning in the lower half of the layers, "high": the upper half, "none": a dense plan)."""
    c = EngineConfig.load(src)
    n = len(c.plan.layers)

    def keeps(index: int) -> bool:
        return sparse != "none" and (index < n // 2) == (sparse == "low")
    layers = tuple(lp if keeps(lp.index) else dataclasses.replace(lp, plugin="dense") for lp in c.plan.layers)
    dense = {"preset": "dense", "infinitehip": None} if sparse == "none" else {}
    config = dataclasses.replace(c, plan=dataclasses.replace(c.plan, layers=layers, **dense))  # validated
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
    ap.add_argument("--sparse", choices=("none", "low", "high"), required=True,
                    help="which layers keep their InfiniteHiP plugin")
    args = ap.parse_args()
    if args.dst.exists():
        raise SystemExit(f"{args.dst} exists; remove it first")
    replan(args.src, args.dst, args.sparse)
    plugins = "".join("s" if lp.plugin == "infinitehip" else "d" for lp in EngineConfig.load(args.dst).plan.layers)
    print(f"{args.dst}: layers {plugins} (s: infinitehip, d: dense)")


if __name__ == "__main__":
    main()
