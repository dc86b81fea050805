"""Prometheus metrics, named like vLLM's (`vllm:` -> `pagedserve:`) so the same
dashboards work after a prefix swap.

Latencies and finished-request counts are measured here, in the frontend.
Scheduler-wide numbers (queue sizes, KV usage, prefix-cache and token
counters) are read from the scheduler's control service when /metrics is
scraped, so they are the same whichever frontend is scraped.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.grpc_gen import control_pb2

PREFIX = "pagedserve:"

# vLLM's buckets, so percentiles are comparable.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]
FINISHED_REASONS = ("stop", "length", "abort")


class SchedulerStatsCollector(Collector):
    """Exposes the last SchedulerStats fetched from the control service; under data
    parallelism, each replica's, with a `replica` label (sum them for the whole)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: control_pb2.SchedulerStats | None = None
        self.replica_stats: list[control_pb2.SchedulerStats | None] | None = None

    def collect(self) -> list[Metric]:
        if self.replica_stats is not None:
            label_names = ["model_name", "replica"]
            series = [([self.model_name, str(i)], s) for i, s in enumerate(self.replica_stats) if s is not None]
        else:
            label_names = ["model_name"]
            series = [([self.model_name], self.stats)] if self.stats is not None else []
        if not series:
            return []  # scheduler unreachable: absent series, not made-up zeros

        def family(kind, name: str, doc: str, value) -> Metric:
            metric = kind(PREFIX + name, doc, labels=label_names)
            for labels, stats in series:
                metric.add_metric(labels, value(stats))
            return metric

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        return [
            family(gauge, "num_requests_running", "Requests in the running batch.", lambda s: s.num_running),
            family(gauge, "num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.num_waiting),
            family(gauge, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
                   lambda s: s.kv_cache_usage),
            family(counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                   lambda s: s.prefix_cache_queries),
            family(counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                   lambda s: s.prefix_cache_hits),
            family(counter, "num_preemptions", "Requests preempted (recomputed later).", lambda s: s.num_preemptions),
            family(counter, "prompt_tokens", "Prompt tokens processed.", lambda s: s.num_prompt_tokens),
            family(counter, "generation_tokens", "Tokens generated.", lambda s: s.num_generation_tokens),
            *self._spec_decode(series, label_names),
        ]

    @staticmethod
    def _spec_decode(series: list, label_names: list[str]) -> list[Metric]:
        """vLLM's spec-decode counters, where speculative decoding has run (absent otherwise)."""
        series = [(labels, s) for labels, s in series if s.spec_decode_num_drafts]
        if not series:
            return []
        metrics = []
        for name, doc, value in (
                ("spec_decode_num_drafts", "Steps of a request that checked draft tokens.",
                 lambda s: s.spec_decode_num_drafts),
                ("spec_decode_num_draft_tokens", "Draft tokens checked.", lambda s: s.spec_decode_num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 lambda s: s.spec_decode_num_accepted_tokens)):
            metric = CounterMetricFamily(PREFIX + name, doc, labels=label_names)
            for labels, stats in series:
                metric.add_metric(labels, value(stats))
            metrics.append(metric)
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the step (0: the first draft).",
                                      labels=[*label_names, "position"])
        for labels, stats in series:
            for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                per_pos.add_metric([*labels, str(position)], count)
        metrics.append(per_pos)
        return metrics


class FrontendMetrics:
    """All metrics of one frontend, in its own registry (tests run several)."""

    def __init__(self, model_name: str, num_replicas: int = 1):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.scheduler_stats = SchedulerStatsCollector(model_name)
        self.registry.register(self.scheduler_stats)
        labels = ["model_name"]
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests, by finish reason.",
            labels + ["finished_reason"], registry=self.registry)
        for reason in FINISHED_REASONS:  # every series exists from the start (rate() needs a zero)
            self.request_success.labels(model_name, reason)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time from arrival to the first generated token.",
            labels, buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between consecutive generated tokens.",
            labels, buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last token.",
            labels, buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        self.requests_resubmitted = Counter(
            PREFIX + "request_resubmissions", "Requests resubmitted, with the tokens they had produced, to a "
            "scheduler that had lost them (restarted, or one that gave up on this frontend).",
            labels, registry=self.registry).labels(model_name)
        self.embedding_requests = Counter(
            PREFIX + "embedding_requests", "Embedding (pooling) requests answered, by outcome: success or error "
            "(rejected or failed); one per input of /v1/embeddings and gRPC Embed.",
            labels + ["outcome"], registry=self.registry)
        for outcome in ("success", "error"):
            self.embedding_requests.labels(model_name, outcome)
        self.embedding_prompt_tokens = Counter(
            PREFIX + "embedding_prompt_tokens", "Input tokens of successful embedding requests.",
            labels, registry=self.registry).labels(model_name)
        self.requests_routed = None
        if num_replicas > 1:  # data parallel: the router's choices
            self.requests_routed = Counter(
                PREFIX + "data_parallel_requests_routed", "Requests this frontend sent to each replica, by why: "
                "prefix (it served the longest prefix of the prompt) or load (the least loaded).",
                labels + ["replica", "reason"], registry=self.registry)
            for replica in range(num_replicas):
                for reason in ("prefix", "load"):
                    self.requests_routed.labels(model_name, str(replica), reason)

    def record_finished(self, finished_reason: str) -> None:
        self.request_success.labels(self.model_name, finished_reason).inc()

    def record_embedding(self, success: bool, num_prompt_tokens: int = 0) -> None:
        self.embedding_requests.labels(self.model_name, "success" if success else "error").inc()
        if success:
            self.embedding_prompt_tokens.inc(num_prompt_tokens)

    def record_resubmitted(self, count: int) -> None:
        self.requests_resubmitted.inc(count)

    def record_routed(self, replica: int, reason: str) -> None:
        if self.requests_routed is not None:
            self.requests_routed.labels(self.model_name, str(replica), reason).inc()

    def render(self, stats: control_pb2.SchedulerStats | None,
               replica_stats: list[control_pb2.SchedulerStats | None] | None = None) -> bytes:
        """The exposition text, with the scheduler's numbers as given (None: omitted);
        with `replica_stats`, each replica's instead, labelled by replica."""
        self.scheduler_stats.stats = stats
        self.scheduler_stats.replica_stats = replica_stats
        return generate_latest(self.registry)


class RequestTimer:
    """Latency bookkeeping for one request."""

    def __init__(self, metrics: FrontendMetrics, arrival: float):
        self.metrics = metrics
        self.arrival = arrival
        self.last_token_time: float | None = None

    def tokens_arrived(self, count: int, now: float) -> None:
        if count <= 0:
            return
        if self.last_token_time is None:
            self.metrics.time_to_first_token.observe(now - self.arrival)
            gaps = [0.0] * (count - 1)  # the rest of the first batch came with the first token
        else:
            gaps = [(now - self.last_token_time) / count] * count  # tokens delivered together share the gap
        for gap in gaps:
            self.metrics.inter_token_latency.observe(gap)
        self.last_token_time = now

    def finished(self, finished_reason: str, now: float) -> None:
        self.metrics.e2e_request_latency.observe(now - self.arrival)
        self.metrics.record_finished(finished_reason)
