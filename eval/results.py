"""Result records, their JSON file, and the markdown summary table.

Every task produces `Record`s (one per sample, or per layer/head for recall) with a `score` in
[0, 1] (or a loss/perplexity for `ppl`, named by `metric`). `EvalResult` holds them with the
settings that produced them; `summary()` averages the score per (engine, length).

    >>> r = EvalResult("passkey", {"lengths": [1024]}, [
    ...     Record("passkey", "smol", 1024, 1.0, depth=0.5, sample=0),
    ...     Record("passkey", "smol", 1024, 0.0, depth=0.9, sample=0)])
    >>> r.summary()
    [{'engine': 'smol', 'length': 1024, 'score': 0.5, 'n': 2}]
    >>> print(r.markdown())
    | engine | metric | 1024 |
    |---|---|---|
    | smol | accuracy | 0.500 (n=2) |
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOWEST_LAYERS = 5  # layers named per (engine, length) under a per-layer result's table


@dataclass
class Record:
    task: str
    engine: str  # engine name (directory name)
    length: int  # prompt / context length in tokens (recall: the layer index goes in `layer`)
    score: float
    metric: str = "accuracy"
    depth: float | None = None
    sample: int | None = None
    variant: str | None = None  # niah variant, agree reference engine, ...
    layer: int | None = None
    head: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # answer text, expected value, timings

    def __post_init__(self) -> None:
        if not math.isfinite(self.score):
            raise ValueError(f"{self.task}: non-finite score {self.score} for {self.engine} at {self.length}")


@dataclass
class EvalResult:
    task: str
    settings: dict[str, Any]
    records: list[Record]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.meta:
            import torch
            self.meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                         "torch": torch.__version__, "python": platform.python_version(),
                         "machine": platform.machine()}

    def summary(self) -> list[dict[str, Any]]:
        """Mean score per (engine, metric, length) in first-seen order (ppl: geometric mean)."""
        groups: dict[tuple[str, str, int], list[float]] = {}
        for r in self.records:
            groups.setdefault((r.engine, r.metric, r.length), []).append(r.score)
        rows = []
        for (engine, metric, length), scores in groups.items():
            # Perplexities of equal-size chunks average geometrically (= exp of the mean NLL).
            mean = (math.exp(sum(math.log(s) for s in scores) / len(scores)) if metric == "ppl"
                    else sum(scores) / len(scores))
            row = {"engine": engine, "length": length, "score": mean, "n": len(scores)}
            if metric != "accuracy":
                row["metric"] = metric
            rows.append(row)
        return rows

    def per_layer(self) -> list[dict[str, Any]]:
        """Mean score per (engine, length, layer) over heads and samples, for the records that
        have a layer (recall); ascending layer within each (engine, length)."""
        groups: dict[tuple[str, int, int], list[float]] = {}
        for r in self.records:
            if r.layer is not None:
                groups.setdefault((r.engine, r.length, r.layer), []).append(r.score)
        order = list(dict.fromkeys((e, n) for e, n, _ in groups))  # (engine, length) first seen
        return [{"engine": e, "length": n, "layer": layer, "score": sum(v) / len(v), "n": len(v)}
                for (e, n, layer), v in sorted(groups.items(), key=lambda kv: (order.index(kv[0][:2]), kv[0][2]))]

    def markdown(self) -> str:
        """One row per (engine, metric), one column per length; with per-layer records (recall)
        a second table names each (engine, length)'s lowest layers."""
        rows = self.summary()
        lengths = sorted({r["length"] for r in rows})
        table: dict[tuple[str, str], dict[int, str]] = {}
        for r in rows:
            table.setdefault((r["engine"], r.get("metric", "accuracy")), {})[r["length"]] = \
                f"{r['score']:.3f} (n={r['n']})"
        lines = ["| engine | metric | " + " | ".join(str(n) for n in lengths) + " |",
                 "|---|---|" + "---|" * len(lengths)]
        for (engine, metric), cells in table.items():
            lines.append(f"| {engine} | {metric} | " + " | ".join(cells.get(n, "") for n in lengths) + " |")
        layers = self.per_layer()
        if layers:
            lines += ["", "| engine | length | lowest layers (0-based: mean over heads and samples) |", "|---|---|---|"]
            for engine, length in dict.fromkeys((r["engine"], r["length"]) for r in layers):
                worst = sorted((r for r in layers if (r["engine"], r["length"]) == (engine, length)),
                               key=lambda r: r["score"])[:LOWEST_LAYERS]
                lines.append(f"| {engine} | {length} | " + ", ".join(f"{r['layer']}: {r['score']:.3f}" for r in worst)
                             + " |")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        d = {"task": self.task, "settings": self.settings, "meta": self.meta, "summary": self.summary()}
        if any(r.layer is not None for r in self.records):
            d["per_layer"] = self.per_layer()
        return {**d, "records": [dataclasses.asdict(r) for r in self.records]}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "EvalResult":
        d = json.loads(Path(path).read_text())
        return cls(d["task"], d["settings"], [Record(**r) for r in d["records"]], d.get("meta", {}))
