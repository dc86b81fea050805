"""Serving statistics, arrival times, comparison records and the charts."""
from __future__ import annotations

import math

import matplotlib.image
from matplotlib.backends.backend_agg import FigureCanvasAgg
import numpy as np
import pytest

from pagedserve.bench.compare import best_of, comparison_record, format_comparison, last_json_line
from pagedserve.bench.charts import bar_chart, line_panels
from pagedserve.bench.serving import RequestRecord, arrival_offsets, percentile, summarize


def test_percentile_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile(list(range(101)), 90) == 90


def test_poisson_arrivals():
    offsets = arrival_offsets(4000, rate=10.0, seed=1)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert abs(gaps.mean() - 0.1) < 0.01  # mean gap 1/rate
    assert abs(gaps.std() - 0.1) < 0.01  # exponential: std = mean
    assert arrival_offsets(5, rate=math.inf, seed=1) == [0.0] * 5
    assert arrival_offsets(50, 3.0, seed=2) == arrival_offsets(50, 3.0, seed=2)


def test_summarize_counts_and_latencies():
    ok = RequestRecord(prompt_tokens=10, ok=True, output_tokens=3, ttft_s=0.1, e2e_s=0.3, itl_s=[0.1, 0.1])
    bad = RequestRecord(prompt_tokens=5, error="HTTP 500")
    result = summarize([ok, ok, bad], duration=2.0, rate=math.inf)
    assert result["completed"] == 2 and result["failed"] == 1 and result["errors"] == ["HTTP 500"]
    assert result["rate"] is None  # inf is not valid JSON
    assert result["output_tokens_per_s"] == 3.0 and result["total_tokens_per_s"] == 13.0
    assert result["ttft_p50_ms"] == 100.0 and result["e2e_p99_ms"] == 300.0 and result["itl_mean_ms"] == 100.0


def test_comparison_record_and_best_run():
    runs = [{"output_tokens_per_s": 90.0}, {"output_tokens_per_s": 120.0}]
    assert best_of(runs)["output_tokens_per_s"] == 120.0
    record = comparison_record("W1", {"pagedserve": {"output_tokens_per_s": 400.0},
                                      "vllm": {"output_tokens_per_s": 320.0},
                                      "transformers": {"output_tokens_per_s": 100.0}})
    assert record == {"workload": "W1", "pagedserve_output_tokens_per_s": 400.0, "vllm_output_tokens_per_s": 320.0,
                      "transformers_output_tokens_per_s": 100.0, "ratio_vs_vllm": 1.25, "ratio_vs_transformers": 4.0}
    assert last_json_line('log line\n{"a": 1}\ntrailing') == {"a": 1}
    with pytest.raises(ValueError):
        last_json_line("no json here")


def test_bar_chart_draws_bars_in_proportion(tmp_path):
    path = tmp_path / "bars.png"
    fig = bar_chart(str(path), "Output tokens/s", ["W1"], {"pagedserve": [400.0], "vllm": [200.0]}, "tok/s")
    heights = {bar.get_label(): [p.get_height() for p in bar] for bar in fig.axes[0].containers}
    assert heights == {"pagedserve": [400.0], "vllm": [200.0]}
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 100


def test_a_bar_charts_long_legend_names_stay_on_the_image(tmp_path):
    path = tmp_path / "bars.png"
    fig = bar_chart(str(path), "Output tokens/s", ["W1", "W2"],
                    {"pagedserve": [400.0, 900.0], "transformers_bfloat16": [40.0, 130.0]}, "tok/s")
    legend = fig.axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["pagedserve", "transformers_bfloat16"]
    renderer = FigureCanvasAgg(fig).get_renderer()
    drawn_from = fig.get_tightbbox(renderer).x0 * fig.dpi  # the leftmost inked pixel of the figure
    width = matplotlib.image.imread(path).shape[1]
    assert legend.get_window_extent(renderer).x1 - drawn_from <= width, "the legend runs off the image"


def test_line_panels_write_a_png(tmp_path):
    path = tmp_path / "lines.png"
    fig = line_panels(str(path), "Scaling", [1, 2, 4], "max_num_seqs",
                      [("tok/s", {"a": [1.0, 2.0, 3.0]}), ("GiB", {"KV cache in use (peak)": [0.1, 0.2, 0.2]})])
    assert len(fig.axes) == 2
    assert list(fig.axes[0].lines[0].get_ydata()) == [1.0, 2.0, 3.0]
    assert fig.axes[1].get_legend().get_texts()[0].get_text() == "KV cache in use (peak)"
    image = matplotlib.image.imread(path)
    assert (image[..., :3] < 0.9).any(), "nothing drawn"


def test_the_comparison_table_says_when_the_kv_cache_is_narrower_than_the_model():
    row = {"output_tokens_per_s": 200.0, "total_tokens_per_s": 600.0, "elapsed_s": 40.0, "load_avg_before": 0.5}
    vllm = {**row, "output_tokens_per_s": 150.0}
    same = format_comparison("W1", {"pagedserve": {**row, "dtype": "float32", "kv_cache_dtype": "float32"},
                                    "vllm": vllm})
    assert "KV cache" not in same and "1.33" in same
    narrowed = format_comparison("W1", {"pagedserve": {**row, "dtype": "float32", "kv_cache_dtype": "bfloat16"},
                                        "vllm": vllm})
    assert narrowed.splitlines()[-1] == "pagedserve ran a float32 model over a bfloat16 KV cache (--kv-cache-dtype)"
