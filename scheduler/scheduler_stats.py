"""What the scheduler reports about itself (control service, stats log, metrics)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of usable blocks held by requests, 0..1
    num_free_blocks: int  # includes free blocks still holding cached prefixes
    num_total_blocks: int  # usable blocks (block 0 excluded)
    prefix_cache_queries: int  # tokens looked up on admission
    prefix_cache_hits: int  # tokens found in the prefix cache
    num_preemptions: int  # cumulative
    num_prompt_tokens: int  # prompt tokens of requests that finished their prefill
    num_generation_tokens: int  # sampled tokens applied
    # Speculative decoding, cumulative: steps of a request with drafts, drafts checked, drafts
    # accepted, and accepted drafts by position (index 0: the first draft of a step).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def scheduler_stats(scheduler) -> SchedulerStats:
    """A `scheduler.scheduler.Scheduler`'s counters and occupancy now."""
    kv = scheduler.kv_cache_manager
    return SchedulerStats(
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting), kv_cache_usage=kv.usage,
        num_free_blocks=kv.num_free_blocks, num_total_blocks=kv.block_pool.num_usable_blocks,
        prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
        num_preemptions=scheduler.num_preemptions, num_prompt_tokens=scheduler.num_prompt_tokens,
        num_generation_tokens=scheduler.num_generation_tokens,
        **scheduler.spec_stats.stats_fields())
