"""What a serving run did to the server's prefix cache, and (data parallel) how it
split over the replicas: from the server's /metrics before and after the run,
the prefix-cache hit rate (prompt tokens found in the cache over those looked
up) overall and per replica, and each replica's share of the tokens (prompt +
generated). A server without pagedserve's /metrics gives nothing (None).
"""
from __future__ import annotations

from typing import Any

Samples = dict[tuple[str, str], float]  # (sample name, replica label or "") -> value
_NAMES = {"pagedserve:prefix_cache_queries_total": "queries", "pagedserve:prefix_cache_hits_total": "hits",
          "pagedserve:prompt_tokens_total": "prompt", "pagedserve:generation_tokens_total": "generated"}


def scrape(base_url: str, timeout: float = 30.0) -> Samples | None:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout)
        response.raise_for_status()
        families = list(text_string_to_metric_families(response.text))
    except Exception:  # not pagedserve, or no /metrics: the run's other numbers still stand
        return None
    samples: Samples = {}
    for family in families:
        for sample in family.samples:
            if sample.name in _NAMES:
                key = (_NAMES[sample.name], sample.labels.get("replica", ""))
                samples[key] = samples.get(key, 0.0) + sample.value
    return samples


def _rate(hits: float, queries: float) -> float | None:
    return round(100 * hits / queries, 2) if queries > 0 else None


def replica_split(before: Samples | None, after: Samples | None) -> dict[str, Any] | None:
    if before is None or after is None:
        return None
    grew = {key: value - before.get(key, 0.0) for key, value in after.items()}
    replicas = sorted({replica for _, replica in grew}, key=lambda r: (len(r), r))
    rows = [{"replica": r, "tokens": int(grew.get(("prompt", r), 0) + grew.get(("generated", r), 0)),
             "prefix_cache_hit_rate_pct": _rate(grew.get(("hits", r), 0), grew.get(("queries", r), 0))}
            for r in replicas]
    total_tokens = sum(row["tokens"] for row in rows)
    for row in rows:
        row["token_share_pct"] = round(100 * row["tokens"] / total_tokens, 2) if total_tokens else None
    hits = sum(v for (name, _), v in grew.items() if name == "hits")
    queries = sum(v for (name, _), v in grew.items() if name == "queries")
    return {"prefix_cache_hit_rate_pct": _rate(hits, queries),
            "replicas": rows if replicas != [""] else []}


def format_split(split: dict[str, Any] | None) -> list[str]:
    if not split:
        return []
    rate = split["prefix_cache_hit_rate_pct"]
    lines = [f"  prefix-cache hits     {'-' if rate is None else f'{rate:.1f} %'} of prompt tokens"]
    for row in split["replicas"]:
        share, rate = row["token_share_pct"], row["prefix_cache_hit_rate_pct"]
        lines.append(f"  replica {row['replica']:<12} {row['tokens']} tokens "
                     f"({'-' if share is None else f'{share:.1f} %'}), prefix-cache hits "
                     f"{'-' if rate is None else f'{rate:.1f} %'}")
    return lines
