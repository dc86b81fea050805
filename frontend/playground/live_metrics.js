// The live server panel: /metrics (open even under --api-key) every 2 s, parsed
// from the Prometheus text format; rates are over the last interval.
"use strict";

const METRICS_INTERVAL_MS = 2000;
const byId = (id) => document.getElementById(id);

// Prometheus text format: each sample name's values summed over its label sets
// (`sum`), and how many label sets it has (`count`: data-parallel replicas).
function parseMetrics(text) {
  const sum = {}, count = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = line.match(/^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)/);
    if (!match) continue;
    const value = Number(match[3]);
    if (Number.isNaN(value)) continue;
    sum[match[1]] = (sum[match[1]] || 0) + value;
    count[match[1]] = (count[match[1]] || 0) + 1;
  }
  return {sum: sum, count: count};
}

const live = {previous: null, previousAt: 0};

function counter(values, name) {
  return values["pagedserve:" + name + "_total"] ?? values["pagedserve:" + name];
}

async function refreshMetrics() {
  try {
    const response = await fetch("/metrics");
    if (!response.ok) throw new Error("HTTP " + response.status);
    const parsed = parseMetrics(await response.text());
    const values = parsed.sum;
    const now = performance.now();
    const gauge = (name) => values["pagedserve:" + name];
    const show = (id, value) => { byId(id).textContent = value === undefined ? "–" : value; };
    show("m-running", gauge("num_requests_running"));
    show("m-waiting", gauge("num_requests_waiting"));
    const kvName = "pagedserve:kv_cache_usage_perc";  // each replica's share of its own cache: the mean
    const kv = parsed.count[kvName] ? values[kvName] / parsed.count[kvName] : undefined;
    show("m-kv", kv === undefined ? undefined : (kv * 100).toFixed(1) + " %");
    const hits = counter(values, "prefix_cache_hits"), queries = counter(values, "prefix_cache_queries");
    const before = live.previous;
    let hitRate;
    if (before && queries > counter(before, "prefix_cache_queries")) {  // over the last interval
      hitRate = (hits - counter(before, "prefix_cache_hits")) / (queries - counter(before, "prefix_cache_queries"));
    } else if (queries > 0) {  // since the start
      hitRate = hits / queries;
    }
    show("m-prefix", hitRate === undefined ? undefined : (hitRate * 100).toFixed(1) + " %");
    const generated = counter(values, "generation_tokens");
    if (before && generated !== undefined && counter(before, "generation_tokens") !== undefined) {
      const rate = (generated - counter(before, "generation_tokens")) / ((now - live.previousAt) / 1000);
      show("m-tps", rate.toFixed(1));
    }
    live.previous = values;
    live.previousAt = now;
    byId("metrics-state").textContent = "live";
  } catch (e) {
    byId("metrics-state").textContent = "(metrics unavailable: " + e.message + ")";
  }
}

function startLiveMetrics() {
  refreshMetrics();
  setInterval(refreshMetrics, METRICS_INTERVAL_MS);
}

window.parseMetrics = parseMetrics;
window.startLiveMetrics = startLiveMetrics;
