"""The benchmark charts (`bench compare --chart`, `bench sweep --chart`), drawn with matplotlib.

matplotlib is an optional dependency (`pip install "pagedserve[bench]"`); it is
imported only when a chart is asked for, with the non-interactive Agg backend.
Each function writes a PNG and returns the matplotlib Figure it drew, so
callers and tests can read back what was plotted.
"""
from __future__ import annotations

from typing import Any

from common.errors import ConfigError


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ConfigError('charts need matplotlib: pip install "pagedserve[bench]"') from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def bar_chart(path: str, title: str, groups: list[str], series: dict[str, list[float]], y_label: str) -> Any:
    """Grouped bars: one group per entry of `groups`, one bar per series in each, values on the bars."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(groups) * max(len(series), 1)), 4.5))
    width = 0.8 / max(len(series), 1)
    for s, (name, values) in enumerate(series.items()):
        xs = [g + (s - (len(series) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(y_label)
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=100, bbox_inches="tight")  # "tight" keeps the outside legend on the image
    plt.close(fig)
    return fig


def line_panels(path: str, title: str, x_values: list[float], x_label: str,
                panels: list[tuple[str, dict[str, list[float]]]], log2_x: bool = True) -> Any:
    """Stacked panels sharing an x axis; each panel is (y label, {series name: values})."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(panels), 1, sharex=True, figsize=(7.0, 2.6 * len(panels)), squeeze=False)
    for ax, (y_label, series) in zip(axes[:, 0], panels):
        for name, values in series.items():
            ax.plot(x_values, values, marker="o", label=name)
        ax.set_ylabel(y_label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    bottom = axes[-1, 0]
    if log2_x and min(x_values) > 0 and max(x_values) > min(x_values):
        bottom.set_xscale("log", base=2)
        bottom.set_xticks(x_values, [f"{x:g}" for x in x_values])
    bottom.set_xlabel(x_label)
    fig.suptitle(title)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return fig

