"""What infhip-bench reports and how: percentiles, the rows `vllm bench serve` prints, a table,
JSON, and an optional plot (matplotlib only if installed).

A serve result's fields have vLLM's names (vllm/benchmarks/serve.py) so that the numbers of
`infhip-bench serve` and `vllm bench serve` line up row by row: TTFT (send to the first token),
TPOT ((end - first token) / (output tokens - 1), per request), ITL (between successive token
events), all in ms.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation (numpy's default); nan when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(values: list[float], scale: float = 1.0) -> dict:
    """mean / median / p99 of values (times scale: 1000 for seconds -> ms)."""
    xs = [v * scale for v in values]
    return {"mean": sum(xs) / len(xs) if xs else math.nan, "median": percentile(xs, 50), "p99": percentile(xs, 99)}


# (label, key) of the block vLLM prints, in its order; "-" rows are its section rules.
SERVE_ROWS = (
    ("Successful requests:", "completed"), ("Failed requests:", "failed"), ("Maximum request concurrency:", "max_concurrency"),
    ("Benchmark duration (s):", "duration"), ("Total input tokens:", "total_input_tokens"),
    ("Total generated tokens:", "total_output_tokens"), ("Request throughput (req/s):", "request_throughput"),
    ("Output token throughput (tok/s):", "output_throughput"), ("Total Token throughput (tok/s):", "total_token_throughput"),
    ("-Time to First Token-", None), ("Mean TTFT (ms):", "mean_ttft_ms"), ("Median TTFT (ms):", "median_ttft_ms"),
    ("P99 TTFT (ms):", "p99_ttft_ms"), ("-Time per Output Token (excl. 1st token)-", None),
    ("Mean TPOT (ms):", "mean_tpot_ms"), ("Median TPOT (ms):", "median_tpot_ms"), ("P99 TPOT (ms):", "p99_tpot_ms"),
    ("-Inter-token Latency-", None), ("Mean ITL (ms):", "mean_itl_ms"), ("Median ITL (ms):", "median_itl_ms"),
    ("P99 ITL (ms):", "p99_itl_ms"))


def serve_block(result: dict, file=None) -> None:
    """One concurrency's result as `vllm bench serve` prints it."""
    file = file or sys.stdout
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="), file=file)
    for label, key in SERVE_ROWS:
        if key is None:
            print("{s:{c}^{n}}".format(s=label.strip("-"), n=50, c="-"), file=file)
            continue
        v = result[key]
        print(f"{label:<40} {v:<10}" if isinstance(v, int) else f"{label:<40} {v:<10.2f}", file=file)
    print("=" * 50, file=file)


def table(rows: list[dict], columns: list[tuple[str, str, str]], file=None) -> None:
    """A fixed-width table: columns are (header, key, format spec)."""
    file = file or sys.stdout
    cells = [[("-" if row.get(key) is None else format(row[key], spec)) for _, key, spec in columns] for row in rows]
    widths = [max([len(h), 7] + [len(c[i]) for c in cells]) for i, (h, _, _) in enumerate(columns)]
    print(" | ".join(f"{h:>{w}}" for (h, _, _), w in zip(columns, widths)), file=file)
    print("-+-".join("-" * w for w in widths), file=file)
    for c in cells:
        print(" | ".join(f"{x:>{w}}" for x, w in zip(c, widths)), file=file)


def write_json(path: Path | None, payload: dict) -> None:
    if path is not None:
        Path(path).write_text(json.dumps(payload, indent=2, default=str) + "\n")


def plot(path: Path | None, rows: list[dict], x: str, ys: list[str], title: str) -> str | None:
    """ys against x as a PNG at path (None: no plot); a note instead when matplotlib is missing."""
    if path is None:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"--plot {path}: matplotlib is not installed (pip install matplotlib); no plot written"
    fig, axes = plt.subplots(1, len(ys), figsize=(4.5 * len(ys), 3.5), squeeze=False)
    for ax, y in zip(axes[0], ys):
        for label in sorted({r.get("label", "") for r in rows}):
            pts = [(r[x], r[y]) for r in rows if r.get("label", "") == label and r.get(y) is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label or None)
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        if any(r.get("label") for r in rows):
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
