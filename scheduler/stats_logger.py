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
        self._spec_seen = (0, 0, 0)  # drafts, draft tokens, accepted tokens at the last line

    def record_step(self, plan: StepPlan, outputs: list[RequestOutput]) -> None:
        generated = sum(len(o.new_token_ids) for o in outputs)
        self._generation_tokens += generated
        # Every scheduled token but the checked drafts and the one token each output sampled
        # from was prompt (prefill) work.
        drafts = sum(len(d) for d in plan.draft_token_ids.values())
        sampled = sum(1 for o in outputs if o.new_token_ids)
        self._prompt_tokens += max(0, sum(plan.num_scheduled_tokens.values()) - drafts - sampled)
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
            self._log_spec_decode(stats)
        self._last_log = now
        self._prompt_tokens = self._generation_tokens = self._steps = 0

    def _log_spec_decode(self, stats) -> None:
        """vLLM's spec-decode line, for the drafts checked since the last one."""
        now = (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens)
        drafts, draft_tokens, accepted = (a - b for a, b in zip(now, self._spec_seen))
        self._spec_seen = now
        if drafts > 0:
            logger.info("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, Drafted: %d tokens, "
                        "Draft acceptance rate: %.1f%%", 1 + accepted / drafts, accepted, draft_tokens,
                        100 * accepted / max(draft_tokens, 1))
