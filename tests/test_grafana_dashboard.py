"""The Grafana dashboard (deploy/grafana/dashboards/pagedserve.json) queries only what the server exports.

Every PromQL expression of the dashboard (panel targets and template-variable queries) is
reduced to the metric names and label names it uses; each must be a sample a real running
`pagedserve serve` exposes on /metrics after one request. Only the frontend serves /metrics
(it also reports the scheduler's numbers); the worker and the tokenizer pool export none.
"""
from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from serve_helpers import MODEL, running_server

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy/grafana/dashboards/pagedserve.json"
# Series Prometheus makes for every scrape target, and labels it attaches to every series.
PROMETHEUS_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped", "scrape_series_added"}
TARGET_LABELS = {"job", "instance"}
KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
            "group_right", "inf", "nan"}
NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
STRING = r'"(?:\\.|[^"\\])*"'


def promql_references(expr: str) -> tuple[dict[str, set[str]], set[str]]:
    """({metric name: label names its matchers use}, label names of by/without/on/ignoring
    groupings) of one PromQL expression. Skips functions and aggregations (a name before
    `(`), keywords, numbers, durations and Grafana's `$variables` (inside strings and ranges)."""
    expr = re.sub(STRING, '""', expr)  # label values, `$variables` included
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # ranges and subqueries: [5m], [$__rate_interval]
    grouped: set[str] = set()

    def grouping(match: re.Match) -> str:
        grouped.update(label.strip() for label in match.group(2).split(",") if label.strip())
        return " "
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", grouping, expr)
    metrics: dict[str, set[str]] = {}

    def selector(match: re.Match) -> str:
        name = match.group(1)
        if not name:
            raise ValueError(f"a selector without a metric name in {expr!r}")
        labels = set(re.findall(rf"({NAME})\s*(?:=~|!~|!=|=)\s*\"\"", match.group(2)))
        metrics.setdefault(name, set()).update(labels)
        return " "
    expr = re.sub(rf"(?<![\w:.])({NAME})?\s*\{{([^}}]*)\}}", selector, expr)
    expr = expr.replace('""', " ")
    for match in re.finditer(rf"(?<![\w:.$])({NAME})(\s*\()?", expr):
        name, is_call = match.group(1), match.group(2)
        if not is_call and name.lower() not in KEYWORDS:
            metrics.setdefault(name, set())
    return metrics, grouped


def dashboard_queries(dashboard: dict) -> list[str]:
    """Every PromQL expression: panel targets, and the metric selectors of label_values() variables."""
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
            assert match, f"variable {variable['name']}: {query!r} is not label_values(selector, label)"
            exprs.append(f"sum by ({match.group(2)}) ({match.group(1)})")
    return exprs


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_the_reference_extractor_skips_functions_groupings_keywords_and_durations():
    expr = ('histogram_quantile(0.99, sum by (le, model_name) '
            '(rate(a:b_bucket{job=~"$job", x!="y{z}"}[$__rate_interval])))'
            ' / on (instance) group_left max without (replica) (c_total offset 5m) > bool 1e3 or vector(0)')
    metrics, grouped = promql_references(expr)
    assert metrics == {"a:b_bucket": {"job", "x"}, "c_total": set()}
    assert grouped == {"le", "model_name", "instance", "replica"}
    with pytest.raises(ValueError, match="without a metric name"):
        promql_references('{__name__="up"}')


def test_the_dashboard_is_grafana_shaped_and_reads_the_datasource_variable(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["uid"] and dashboard["title"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in "hwxy") and grid["x"] + grid["w"] <= 24, panel["title"]
        area = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        if panel["type"] == "row":
            continue
        assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}" and target["expr"].strip(), panel["title"]
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == "${datasource}", variable["name"]


@pytest.mark.slow  # a real server and load: about a minute
def test_every_metric_the_dashboard_queries_is_exported_by_a_running_server(dashboard, tmp_path):
    # The C++ kernels change no metric; without them no first-use compile delays the start.
    with running_server(tmp_path, [], env={"PAGEDSERVE_CPU_KERNELS": "0"}) as server:
        body = json.dumps({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
                           "temperature": 0}).encode()
        request = urllib.request.Request(server.base_url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            assert json.load(response)["usage"]["completion_tokens"] == 4
        with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as response:
            text = response.read().decode()
    from prometheus_client.parser import text_string_to_metric_families
    exported: dict[str, set[str]] = {}  # sample name -> its label names
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            exported.setdefault(sample.name, set()).update(sample.labels)
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    queried: dict[str, set[str]] = {}
    grouped: set[str] = set()
    for expr in dashboard_queries(dashboard):
        metrics, groups = promql_references(expr)
        for name, labels in metrics.items():
            queried.setdefault(name, set()).update(labels)
        grouped |= groups
    assert len(queried) >= 10, sorted(queried)
    for name, labels in queried.items():
        if name in PROMETHEUS_SERIES:
            assert labels <= TARGET_LABELS, f"{name} is matched on {labels - TARGET_LABELS}"
            continue
        assert name in exported, f"the dashboard queries {name}, which the server does not export"
        assert labels <= exported[name] | TARGET_LABELS, f"{name} has no label {labels - exported[name]}"
        if name.endswith("_count") or name.endswith("_bucket"):
            assert values[name] > 0, f"{name}: one request made no observation"
    all_labels = set().union(*(exported[n] for n in queried if n in exported))
    assert grouped <= all_labels | TARGET_LABELS, f"grouped by unknown labels {grouped - all_labels}"


def test_the_preview_script_replaces_every_grafana_variable(dashboard):
    """scripts/dashboard_preview.py (the README picture) sends Prometheus no `$variable`."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("dashboard_preview", ROOT / "scripts/dashboard_preview.py")
    preview = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(preview)
    for expr in dashboard_queries(dashboard):
        sent = preview.substitute(expr, "20s")
        assert "$" not in sent and ("rate(" not in sent or "[20s]" in sent), sent
    assert preview.substitute('rate(x{job=~"$job"}[$__rate_interval])', "1m") == 'rate(x{job=~".+"}[1m])'
    assert preview.legend("{{replica}} p{{ le }}", {"replica": "0", "le": "1"}) == "0 p1"
