"""Plots of results with matplotlib (Agg backend: no display needed).

Length tasks (passkey, niah, ppl, agree): score vs context length, one line per engine (and
metric or variant). recall: recall per layer, one line per engine, heads averaged, with the
per-head spread as a band.

    >>> from infhip.eval.results import EvalResult, Record
    >>> r = EvalResult("passkey", {}, [Record("passkey", "e", 1024, 1.0), Record("passkey", "e", 2048, 0.5)])
    >>> plot_result(r, tmp_path / "p.png")                                       # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path

from infhip.eval.results import EvalResult


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # before pyplot is imported anywhere: headless machines and CI
    import matplotlib.pyplot as plt

    return plt


def plot_result(result: EvalResult, path: str | Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    if result.task == "recall":
        _recall(ax, result)
    else:
        _vs_length(ax, result)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _vs_length(ax, result: EvalResult) -> None:
    lines: dict[str, dict[int, list[float]]] = {}
    for r in result.records:
        label = r.engine + (f" {r.variant}" if r.variant else "") + (f" {r.metric}" if r.metric != "accuracy" else "")
        lines.setdefault(label, {}).setdefault(r.length, []).append(r.score)
    for label, by_len in lines.items():
        xs = sorted(by_len)
        ax.plot(xs, [sum(by_len[x]) / len(by_len[x]) for x in xs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ticks = sorted({r.length for r in result.records})
    ax.set_xticks(ticks, [f"{t / 1024:g}K" if t % 256 == 0 else str(t) for t in ticks])
    ax.set_xlabel("context length (tokens)")
    metrics = {r.metric for r in result.records}
    ax.set_ylabel("/".join(sorted(metrics)))
    if metrics == {"accuracy"}:
        ax.set_ylim(-0.05, 1.05)
    ax.set_title(result.task)


def _recall(ax, result: EvalResult) -> None:
    per: dict[str, dict[int, list[float]]] = {}
    for r in result.records:
        if r.layer is not None:
            per.setdefault(f"{r.engine} @{r.length}", {}).setdefault(r.layer, []).append(r.score)
    for label, by_layer in per.items():
        xs = sorted(by_layer)
        mean = [sum(by_layer[x]) / len(by_layer[x]) for x in xs]
        ax.plot(xs, mean, marker="o", label=label)
        ax.fill_between(xs, [min(by_layer[x]) for x in xs], [max(by_layer[x]) for x in xs], alpha=0.2)
    ax.set_xlabel("layer (0-based)")
    ax.set_ylabel("attention recall (heads: mean, band = min..max)")
    ax.set_ylim(0, 1.02)
    ax.set_title("recall")
