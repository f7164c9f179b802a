"""The short table of `bash benchmarks/gpu/run.sh quality qwen` from the JSON files it wrote.

    python3 -m benchmarks.quality.qwen_summary /tmp/qwen-results

Prints the per-task RULER tables the runs wrote (`*.md`), then one row per (measure, engine),
one column per length: RULER means (every task has the same samples, so the mean over records
is the mean over tasks), passkey accuracy, PG-essay perplexity, mean attention recall of the
final masks, and token drop's RULER mean with its measured retention ρ next to the dense
engine's mean on the same samples; any other JSON (the `qwen-knobs` runs) as one row per engine
under its file name. A file a step did not write (cut at the deadline) is skipped.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

LENGTHS = (8192, 16384, 32768, 65536, 131072)


def _records(path: Path) -> list[dict]:
    return json.loads(path.read_text())["records"] if path.is_file() else []


def _cell(values: list[float], fmt: str) -> str:
    return fmt.format(sum(values) / len(values)) + f" (n={len(values)})" if values else ""


def rows(name: str, records: list[dict], fmt: str, keep=lambda r: True, geometric: bool = False) -> list[str]:
    """One markdown row per engine: mean score per length over the records `keep` accepts."""
    out = []
    for engine in dict.fromkeys(r["engine"] for r in records):
        cells = []
        for n in LENGTHS:
            v = [r["score"] for r in records if r["engine"] == engine and r["length"] == n and keep(r)]
            if geometric and v:  # perplexities: exp of the mean log
                v = [math.exp(sum(math.log(x) for x in v) / len(v))] * len(v)
            cells.append(_cell(v, fmt))
        out.append(f"| {name} | {engine} | " + " | ".join(cells) + " |")
    return out


def retention_row(p: str, records: list[dict]) -> str:
    cells = [_cell([r["extra"]["retention"] for r in records if r["length"] == n and "retention" in r["extra"]],
                   "{:.3f}") for n in LENGTHS]
    return f"| token drop p={p}: retention ρ | dense + drop | " + " | ".join(cells) + " |"


def main(folder: str) -> None:
    w = Path(folder)
    for md in sorted(w.glob("ruler_*.md")):
        print(f"### {md.stem}\n\n{md.read_text()}")
    lines = ["| measure | engine | 8K | 16K | 32K | 64K | 128K |", "|---|---|---|---|---|---|---|"]
    dense = _records(w / "ruler_dense.json")
    lines += rows("RULER mean, 9 tasks (chat template)", dense, "{:.1f}")
    lines += rows("passkey, PG haystack, 5 depths", _records(w / "passkey_dense.json"), "{:.2f}")
    lines += rows("PG perplexity, last 256 tokens", _records(w / "ppl_dense.json"), "{:.2f}", geometric=True)
    lines += rows("RULER mean, 5 NIAH tasks", _records(w / "ruler_ih.json"), "{:.1f}")
    lines += rows("passkey, PG haystack, 5 depths", _records(w / "passkey_ih.json"), "{:.2f}")
    lines += rows("PG perplexity, last 256 tokens", _records(w / "ppl_ih.json"), "{:.2f}", geometric=True)
    lines += rows("attention recall, final mask (mean over layers, heads)", _records(w / "recall_3k.json"), "{:.3f}")
    for p in ("0.99", "0.98"):
        drop = _records(w / f"ruler_drop{p}.json")
        if drop:
            samples = {r["sample"] for r in drop}
            lines += rows(f"RULER mean, dense, samples {sorted(samples)}", dense, "{:.1f}", lambda r: r["sample"] in samples)
            lines += rows(f"RULER mean, token drop p={p}", drop, "{:.1f}")
            lines.append(retention_row(p, drop))
    known = {"ruler_dense", "passkey_dense", "ppl_dense", "ruler_ih", "passkey_ih", "ppl_ih", "recall_3k",
             "ruler_drop0.99", "ruler_drop0.98"}
    for other in sorted(f for f in w.glob("*.json") if f.stem not in known):  # the knob runs (qwen-knobs)
        lines += rows(f"{other.stem} (score mean)", _records(other), "{:.2f}")
    skipped = w / "skipped.txt"
    if skipped.is_file():
        lines += ["", "Not run to the end: " + "; ".join(skipped.read_text().split("\n")).strip("; ")]
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1])
