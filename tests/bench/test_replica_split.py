"""The prefix-cache and per-replica numbers `bench serving` takes from /metrics before and after a run."""
from pagedserve.bench.replica_split import format_split, replica_split


def test_per_replica_token_shares_and_hit_rates_from_the_counters_growth():
    before = {("queries", "0"): 10, ("hits", "0"): 0, ("prompt", "0"): 10, ("generated", "0"): 5}
    after = {("queries", "0"): 110, ("hits", "0"): 50, ("prompt", "0"): 110, ("generated", "0"): 105,
             ("queries", "1"): 100, ("hits", "1"): 90, ("prompt", "1"): 100, ("generated", "1"): 500}
    split = replica_split(before, after)
    assert split["prefix_cache_hit_rate_pct"] == 70.0
    assert split["replicas"] == [
        {"replica": "0", "tokens": 200, "prefix_cache_hit_rate_pct": 50.0, "token_share_pct": 25.0},
        {"replica": "1", "tokens": 600, "prefix_cache_hit_rate_pct": 90.0, "token_share_pct": 75.0}]
    assert format_split(split)[1].split() == ["replica", "0", "200", "tokens", "(25.0", "%),", "prefix-cache",
                                              "hits", "50.0", "%"]


def test_one_replica_reports_the_hit_rate_alone_and_no_metrics_nothing():
    split = replica_split({}, {("queries", ""): 100, ("hits", ""): 40, ("prompt", ""): 100})
    assert split == {"prefix_cache_hit_rate_pct": 40.0, "replicas": []}
    assert replica_split(None, {}) is None and format_split(None) == []
