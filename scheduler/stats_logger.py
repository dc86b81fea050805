"""The periodic stats line (throughput, running, waiting, KV usage), like vLLM's."""
from __future__ import annotations

import logging
import time

from common.protocol import RequestOutput, StepPlan

logger = logging.getLogger("pagedserve.stats")

LOG_INTERVAL_S = 5.0


class StatsLogger:
    def __init__(self, enabled: bool = True, interval_s: float = LOG_INTERVAL_S):
        self.enabled = enabled
        self.interval_s = interval_s
        self._last_log = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._steps = 0

    def record_step(self, plan: StepPlan, outputs: list[RequestOutput]) -> None:
        generated = sum(len(o.new_token_ids) for o in outputs)
        self._generation_tokens += generated
        # Every scheduled token that did not produce an output token was prompt (prefill) work.
        self._prompt_tokens += max(0, sum(plan.num_scheduled_tokens.values()) - generated)
        self._steps += 1

    def maybe_log(self, scheduler) -> None:
        now = time.monotonic()
        elapsed = now - self._last_log
        if not self.enabled or scheduler is None or elapsed < self.interval_s:
            return
        stats = scheduler.stats()
        idle = self._steps == 0 and stats.num_running == 0 and stats.num_waiting == 0
        if not idle:
            hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%, "
                "Preemptions: %d", self._prompt_tokens / elapsed, self._generation_tokens / elapsed,
                stats.num_running, stats.num_waiting, 100 * stats.kv_cache_usage, 100 * hit_rate,
                stats.num_preemptions)
        self._last_log = now
        self._prompt_tokens = self._generation_tokens = self._steps = 0
