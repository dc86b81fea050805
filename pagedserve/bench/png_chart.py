"""Bar and line charts written as PNG with numpy and zlib alone (no plotting library).

Enough for the benchmark reports: axes with labelled ticks, grouped bars with
value labels, lines with point markers, a legend and a title.
"""
from __future__ import annotations

import math
import struct
import zlib

import numpy as np

from pagedserve.bench.bitmap_font import GLYPH_HEIGHT, GLYPH_WIDTH, glyph, text_width

WHITE, BLACK, GREY = (255, 255, 255), (30, 30, 30), (210, 210, 210)
PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]


class Canvas:
    def __init__(self, width: int, height: int):
        self.pixels = np.full((height, width, 3), 255, dtype=np.uint8)

    @property
    def width(self) -> int:
        return self.pixels.shape[1]

    @property
    def height(self) -> int:
        return self.pixels.shape[0]

    def rect(self, x0: float, y0: float, x1: float, y1: float, color: tuple[int, int, int]) -> None:
        xa, xb = sorted((int(round(x0)), int(round(x1))))
        ya, yb = sorted((int(round(y0)), int(round(y1))))
        self.pixels[max(ya, 0):max(yb, 0) + 1, max(xa, 0):max(xb, 0) + 1] = color

    def line(self, x0: float, y0: float, x1: float, y1: float, color: tuple[int, int, int], width: int = 2) -> None:
        steps = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for t in np.linspace(0.0, 1.0, steps + 1):
            x, y = x0 + (x1 - x0) * t, y0 + (y1 - y0) * t
            self.rect(x - width // 2, y - width // 2, x + (width - 1) // 2, y + (width - 1) // 2, color)

    def text(self, x: float, y: float, text: str, color: tuple[int, int, int] = BLACK, scale: int = 2,
             anchor: str = "left") -> None:
        """Draw `text` with its top at y; anchor 'left', 'center' or 'right' of x."""
        if anchor == "center":
            x -= text_width(text, scale) / 2
        elif anchor == "right":
            x -= text_width(text, scale)
        x, y = int(round(x)), int(round(y))
        for char in text:
            mask = np.kron(glyph(char), np.ones((scale, scale), dtype=bool))
            h, w = mask.shape
            region = self.pixels[y:y + h, x:x + w]
            region[mask[:region.shape[0], :region.shape[1]]] = color
            x += (GLYPH_WIDTH + 1) * scale

    def save_png(self, path: str) -> None:
        height, width, _ = self.pixels.shape
        raw = b"".join(b"\x00" + self.pixels[row].tobytes() for row in range(height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
               + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
        with open(path, "wb") as f:
            f.write(png)


def nice_ticks(top: float, count: int = 5) -> list[float]:
    """Round tick values from 0 to at least `top`."""
    if top <= 0:
        return [0.0, 1.0]
    raw = top / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    return [step * i for i in range(int(math.ceil(top / step)) + 1)]


def _label(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}".rstrip("0").rstrip(".")
    return f"{value:.2f}".rstrip("0").rstrip(".")


class Plot:
    """A plotting area on a canvas with a y axis from 0 to the top tick."""

    def __init__(self, canvas: Canvas, left: int, top: int, right: int, bottom: int, y_max: float, y_label: str):
        self.canvas, self.left, self.top, self.right, self.bottom = canvas, left, top, right, bottom
        self.ticks = nice_ticks(y_max)
        self.y_max = self.ticks[-1]
        for tick in self.ticks:
            y = self.y(tick)
            canvas.line(left, y, right, y, GREY, width=1)
            canvas.text(left - 8, y - GLYPH_HEIGHT, _label(tick), anchor="right")
        canvas.line(left, top, left, bottom, BLACK)
        canvas.line(left, bottom, right, bottom, BLACK)
        canvas.text(left, top - 26, y_label)

    def y(self, value: float) -> float:
        return self.bottom - (self.bottom - self.top) * value / self.y_max


def legend_width(names: list[str]) -> int:
    """Room for `legend` right of a plot: swatch, the longest name, a margin."""
    return 22 + max((text_width(name, 2) for name in names), default=0) + 20


def legend(canvas: Canvas, x: int, y: int, names: list[str]) -> None:
    for i, name in enumerate(names):
        canvas.rect(x, y + i * 22, x + 14, y + i * 22 + 14, PALETTE[i % len(PALETTE)])
        canvas.text(x + 22, y + i * 22, name)


def bar_chart(path: str, title: str, groups: list[str], series: dict[str, list[float]], y_label: str) -> None:
    """Grouped bars: one group per entry of `groups`, one bar per series in each."""
    names = list(series)
    side = legend_width(names) + 20  # the legend right of the plot, never cut off
    canvas = Canvas(110 + 90 * len(groups) * max(len(series), 1) + 40 * len(groups) + side, 520)
    values = [v for vs in series.values() for v in vs]
    plot = Plot(canvas, 110, 80, canvas.width - side, 440, max(values, default=1.0) * 1.1, y_label)
    canvas.text(canvas.width / 2, 16, title, anchor="center", scale=3)
    group_width = (plot.right - plot.left) / max(len(groups), 1)
    bar_width = group_width * 0.8 / max(len(series), 1)
    for g, group in enumerate(groups):
        x0 = plot.left + g * group_width + group_width * 0.1
        for s, values in enumerate(series.values()):
            value = values[g]
            bx = x0 + s * bar_width
            canvas.rect(bx + 2, plot.y(value), bx + bar_width - 2, plot.bottom - 1, PALETTE[s % len(PALETTE)])
            canvas.text(bx + bar_width / 2, plot.y(value) - 18, _label(value), anchor="center")
        canvas.text(plot.left + (g + 0.5) * group_width, plot.bottom + 12, group, anchor="center")
    legend(canvas, plot.right + 20, plot.top, names)
    canvas.save_png(path)


def line_panels(path: str, title: str, x_values: list[float], x_label: str,
                panels: list[tuple[str, dict[str, list[float]]]], log2_x: bool = True) -> None:
    """Stacked panels sharing an x axis; each panel is (y label, {series name: values})."""
    legend_room = legend_width([name for _, series in panels for name in series])
    panel_height, width = 300, 710 + legend_room  # the legend right of the plots, never cut off
    canvas = Canvas(width, 90 + len(panels) * (panel_height + 100) + 40)
    canvas.text(width / 2, 16, title, anchor="center", scale=3)
    xs = [math.log2(x) if log2_x else x for x in x_values]
    x_lo, x_hi = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    for p, (y_label, series) in enumerate(panels):
        top = 90 + p * (panel_height + 100)
        values = [v for vs in series.values() for v in vs]
        plot = Plot(canvas, 110, top, width - legend_room - 20, top + panel_height, max(values, default=1.0) * 1.1,
                    y_label)

        def px(x: float) -> float:
            return plot.left + 20 + (plot.right - plot.left - 40) * (x - x_lo) / (x_hi - x_lo)

        for x_value, x in zip(x_values, xs):
            canvas.text(px(x), plot.bottom + 10, _label(x_value), anchor="center")
        for s, values in enumerate(series.values()):
            color = PALETTE[s % len(PALETTE)]
            points = [(px(x), plot.y(v)) for x, v in zip(xs, values)]
            for (xa, ya), (xb, yb) in zip(points, points[1:]):
                canvas.line(xa, ya, xb, yb, color, width=3)
            for x, y in points:
                canvas.rect(x - 4, y - 4, x + 4, y + 4, color)
        legend(canvas, plot.right + 20, plot.top, list(series))
        canvas.text((plot.left + plot.right) / 2, plot.bottom + 34, x_label, anchor="center")
    canvas.save_png(path)
