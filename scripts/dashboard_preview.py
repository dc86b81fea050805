"""Draw a preview of the Grafana dashboard's panels with matplotlib (not a Grafana screenshot).

Runs every panel's PromQL of deploy/grafana/dashboards/pagedserve.json against a real
Prometheus (its HTTP API, query_range) over a time window and plots each panel as a line
chart, laid out in the dashboard's rows. Grafana's variables are replaced: $job and
$model_name match everything, $__rate_interval becomes --rate-interval.

How docs/images/dashboard.png was made, on one shared 2-core CPU machine without Grafana
(smollm2-135m-instruct, bfloat16, C++ kernels on; Debian's prometheus 2.42):
    pagedserve serve --port 8000 --kv-cache-memory 256MiB &    # 364 blocks: W2 below preempts
    prometheus --config.file=prom.yml &      # scrape_interval 2s, one job scraping 127.0.0.1:8000
    B="--base-url http://127.0.0.1:8000"
    pagedserve bench serving $B --workload W1 --num-requests 24 --rate 0.5 --max-concurrency 8
    pagedserve bench serving $B --workload P1 --num-requests 32 --rate 1 --max-concurrency 8
    pagedserve bench serving $B --workload W2 --num-requests 48 --max-concurrency 48
    # then four streamed completions cut off by the client (the aborts)
    python scripts/dashboard_preview.py --prometheus http://127.0.0.1:9090 --minutes 9.2 \\
        --output docs/images/dashboard.png
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy/grafana/dashboards/pagedserve.json"
PERCENT_UNITS = {"percentunit"}


def substitute(expr: str, rate_interval: str) -> str:
    """The expression Grafana would send, with every variable matching all its values."""
    expr = expr.replace("$__rate_interval", rate_interval)
    return re.sub(r"\$\{?(job|model_name)\}?", ".+", expr)


def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{params}", timeout=60) as response:
        body = json.load(response)
    if body.get("status") != "success":
        raise ValueError(f"Prometheus refused {expr!r}: {body.get('error')}")
    return body["data"]["result"]


def legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip() or "value"


def draw(dashboard: dict, prometheus: str, start: float, end: float, step: float, rate_interval: str,
         output: str) -> int:
    """Plot every panel; returns how many panels had data."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: list[tuple[str, list[dict]]] = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            rows.append((panel["title"], []))
        else:
            rows[-1][1].append(panel)
    columns = max(len(panels) for _, panels in rows)
    fig, axes = plt.subplots(len(rows), columns, figsize=(5.2 * columns, 3.3 * len(rows)), squeeze=False)
    with_data = 0
    for r, (row_title, panels) in enumerate(rows):
        for c in range(columns):
            ax = axes[r][c]
            if c >= len(panels):
                ax.set_visible(False)
                continue
            panel = panels[c]
            lines = 0
            for target in panel["targets"]:
                for series in query_range(prometheus, substitute(target["expr"], rate_interval), start, end, step):
                    xs = [(float(t) - start) / 60 for t, _ in series["values"]]
                    ys = [float(v) for _, v in series["values"]]
                    if all(math.isnan(y) for y in ys):
                        continue
                    ax.plot(xs, ys, label=legend(target.get("legendFormat", ""), series["metric"]))
                    lines += 1
            with_data += lines > 0
            ax.set_title(panel["title"], fontsize=10)
            if c == 0:
                ax.annotate(row_title, (0, 1.18), xycoords="axes fraction", fontsize=11, fontweight="bold")
            unit = panel["fieldConfig"]["defaults"].get("unit", "")
            if unit in PERCENT_UNITS:
                ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
            elif unit == "s":
                ax.set_ylabel("seconds", fontsize=8)
            ax.set_xlim(0, (end - start) / 60)
            ax.set_xlabel("minutes", fontsize=8)
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
            if lines:
                ax.legend(fontsize=7, loc="upper left")
            else:
                ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    fig.suptitle("Preview of the pagedserve Grafana dashboard's panels: its PromQL run on Prometheus, drawn "
                 "with matplotlib", fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.97), h_pad=2.5)
    fig.savefig(output, dpi=80)
    return with_data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prometheus", required=True, help="Prometheus' base URL, e.g. http://127.0.0.1:9090")
    parser.add_argument("--minutes", type=float, default=10.0, help="the window, ending now (default 10)")
    parser.add_argument("--step", type=float, default=5.0, help="seconds between points (default 5)")
    parser.add_argument("--rate-interval", default="20s", help="what $__rate_interval becomes (default 20s)")
    parser.add_argument("--dashboard", default=str(DASHBOARD))
    parser.add_argument("--output", required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.step <= 0:
        parser.error("--minutes and --step must be positive")
    if not re.fullmatch(r"\d+[smh]", args.rate_interval):
        parser.error(f"--rate-interval {args.rate_interval!r} is not a Prometheus duration like 20s")
    end = time.time()
    dashboard = json.loads(Path(args.dashboard).read_text())
    with_data = draw(dashboard, args.prometheus.rstrip("/"), end - 60 * args.minutes, end, args.step,
                     args.rate_interval, args.output)
    print(f"{args.output}: {with_data} panels with data")
    return 0


if __name__ == "__main__":
    sys.exit(main())
