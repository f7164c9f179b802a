"""The past-the-window table from the JSON files `bash benchmarks/gpu/run.sh window ...` wrote.

    python3 -m benchmarks.quality.window_summary /tmp/window-results [--baseline q05-yarn4]

One row per engine (the engine folder's name), per length three cells: RULER NIAH mean (the
`ruler_*.json` files; n = prompts), PG passkey accuracy (`passkey_*.json`), and the wall time of
those prompts with its ratio to the baseline engine's time for the same prompts (each prompt's
share of its batch's `generate` time, summed; the engines of one file ran one after another in
one process, files beside each other on the same GPU, so the ratio holds within a file best).
A file a step did not write is skipped; engines missing a cell show "—". Also writes
summary.json beside the files (the same cells as numbers).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def load(folder: Path) -> dict:
    """{(task, engine, length): {"scores": [...], "seconds": float}} over every ruler_/passkey_ file."""
    cells: dict = defaultdict(lambda: {"scores": [], "seconds": 0.0})
    for path in sorted(folder.glob("ruler_*.json")) + sorted(folder.glob("passkey_*.json")):
        task = "niah" if path.name.startswith("ruler_") else "passkey"
        for r in json.loads(path.read_text())["records"]:
            cell = cells[(task, r["engine"], r["length"])]
            cell["scores"].append(r["score"] / (100.0 if task == "niah" else 1.0))  # RULER scores are percents
            cell["seconds"] += r.get("extra", {}).get("seconds", 0.0)
    return dict(cells)


def table(cells: dict, baseline: str | None) -> tuple[str, list[dict]]:
    engines = list(dict.fromkeys(e for _, e, _ in cells))
    lengths = sorted({n for _, _, n in cells})
    head = "| engine | " + " | ".join(f"NIAH {n // 1024}K | passkey {n // 1024}K | time {n // 1024}K (× base)"
                                      for n in lengths) + " |"
    lines = [head, "|---|" + "---:|" * (3 * len(lengths))]
    rows = []
    for e in engines:
        row, cols = {"engine": e}, []
        for n in lengths:
            for task in ("niah", "passkey"):
                c = cells.get((task, e, n))
                acc = sum(c["scores"]) / len(c["scores"]) if c else None
                row[f"{task}_{n}"] = {"accuracy": acc, "n": len(c["scores"]) if c else 0}
                cols.append(f"{acc:.3f} (n={len(c['scores'])})" if c else "—")
            secs = sum(cells[(t, e, n)]["seconds"] for t in ("niah", "passkey") if (t, e, n) in cells)
            base = sum(cells[(t, baseline, n)]["seconds"] for t in ("niah", "passkey") if (t, baseline, n) in cells
                       and (t, e, n) in cells) if baseline else 0.0
            row[f"seconds_{n}"] = secs
            cols.append(f"{secs:.1f} s" + (f" ({secs / base:.2f})" if base > 0 and secs > 0 else "") if secs else "—")
        rows.append(row)
        lines.append(f"| {e} | " + " | ".join(cols) + " |")
    return "\n".join(lines), rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--baseline", help="the engine whose time the others are divided by (dense + YaRN)")
    a = ap.parse_args(argv)
    cells = load(a.folder)
    if not cells:
        raise SystemExit(f"{a.folder}: no ruler_*.json or passkey_*.json with records")
    md, rows = table(cells, a.baseline)
    (a.folder / "summary.json").write_text(json.dumps({"baseline": a.baseline, "rows": rows}, indent=1))
    print(md)


if __name__ == "__main__":
    main()
