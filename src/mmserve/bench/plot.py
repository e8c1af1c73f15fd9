"""`--plot FILE.png`: TTFT per run beside each cache layer's hit rate per run (matplotlib, imported lazily)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmserve.bench.report import RunReport

INSTALL_HINT = "--plot needs matplotlib: pip install 'mmserve[bench]' (or pip install matplotlib)"


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def require_matplotlib() -> Any:
    """`matplotlib.pyplot` on the non-interactive Agg backend; `PlotUnavailable` if it is missing."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(INSTALL_HINT) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_runs(reports: list[RunReport], path: str | Path, title: str = "mmserve bench serve") -> None:
    """Left: mean / median / p99 TTFT per run. Right: each layer's hit rate per run (layers with data)."""
    plt = require_matplotlib()
    fig, (ax_ttft, ax_hits) = plt.subplots(1, 2, figsize=(11, 4.2))
    runs = [f"run {r.run}\n({r.label})" for r in reports]
    _grouped_bars(ax_ttft, runs, {stat: [getattr(r, f"{stat}_ttft_ms") or 0.0 for r in reports]
                                  for stat in ("mean", "median", "p99")})
    ax_ttft.set_ylabel("TTFT (ms)")
    ax_ttft.set_title("Time to first token")
    layers = [layer for layer in reports[0].cache_hit_rate
              if any(r.cache_hit_rate.get(layer) is not None for r in reports)] if reports else []
    _grouped_bars(ax_hits, layers, {run.replace("\n", " "): [100 * (r.cache_hit_rate.get(layer) or 0.0)
                                                               for layer in layers]
                                    for run, r in zip(runs, reports)})
    ax_hits.set_ylim(0, 125)  # a fixed scale, with room for the legend above 100%
    ax_hits.set_yticks(range(0, 101, 20))
    ax_hits.set_ylabel("hit rate (%)")
    ax_hits.set_title("Cache hit rate during the run" if layers else "No cache layer reported queries")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _grouped_bars(ax: Any, groups: list[str], series: dict[str, list[float]]) -> None:
    """One group of bars per entry of `groups`, one bar per series within each group."""
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    if series and groups:
        top = max((v for values in series.values() for v in values), default=0.0)
        ax.set_ylim(0, top * 1.25 or 1.0)  # room for the legend above the tallest bar
        ax.legend(fontsize="small", loc="upper right", ncol=min(len(series), 3))
