"""The scheduler's side of speculative decoding: which drafts a step checks,
and the counts behind the spec-decode metrics.

The worker proposes drafts after each step it samples in (StepResult.proposals);
the next plan checks them, unless the batch is too big (`disable_by_batch_size`),
the request cannot be verified exactly (structured output), or the drafts would
run past the token budget, max_tokens or max_model_len: then fewer, or none.
"""
from __future__ import annotations

from common.speculative_config import SpeculativeConfig
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.request import Request


def speculating(config: SpeculativeConfig | None, num_running: int) -> bool:
    """Whether a step checks drafts (and the worker proposes more): speculation is on and fewer
    requests run than `disable_by_batch_size`."""
    return config is not None and num_running < config.disable_by_batch_size


def can_speculate(request: Request) -> bool:
    """Whether drafts for this request can be verified exactly: a grammar's state would have to
    follow every draft, so structured outputs run without speculation."""
    return request.sampling_params.structured_outputs is None


def drafts_to_check(request: Request, budget: int, max_model_len: int) -> list[int]:
    """The request's pending drafts that fit this step (it decodes: one token to compute): each
    accepted draft is an output token, so at most max_tokens - outputs - 1 of them (the step adds
    one more token of its own), within max_model_len and the token budget besides the decode."""
    drafts = request.spec_token_ids
    if not drafts or not can_speculate(request):
        return []
    room = min(budget - 1, request.max_tokens - request.num_output_tokens - 1,
               max_model_len - request.num_tokens - 1)
    return drafts[:max(room, 0)]


def lookahead_slots(request: Request, num_computed: int, num_new: int, lookahead: int, max_model_len: int) -> int:
    """KV slots past a step's `num_new` tokens (after `num_computed`) for a draft model to run
    ahead in: only when the chunk reaches the request's last known token (it samples, then
    proposes), within max_model_len."""
    if not lookahead or num_computed + num_new < request.num_tokens or not can_speculate(request):
        return 0
    return max(0, min(lookahead, max_model_len - num_computed - num_new))


def roll_back_rejected(kv: KVCacheManager, stats: "SpecDecodeStats", request: Request, num_checked: int,
                       num_accepted: int) -> None:
    """After a step checked `num_checked` drafts: the rejected ones' KV is not the sequence's.
    Uncount it, and give back the blocks only they (and a draft model's lookahead) used; the
    next plan tells the worker (`Request.blocks_trimmed`)."""
    if not 0 <= num_accepted <= num_checked:
        raise ValueError(f"{request.request_id}: {num_accepted} of {num_checked} drafts accepted")
    stats.record(num_checked, num_accepted)
    request.num_computed_tokens -= num_checked - num_accepted
    # Keep the slot of the token this step adds (the next step computes it).
    if kv.trim(request, request.num_computed_tokens + 1):
        request.blocks_trimmed = True


class SpecDecodeStats:
    """Cumulative counts, as vLLM's spec-decode metrics: steps with drafts, drafts checked,
    drafts accepted, and accepted drafts by position (index 0: the first draft)."""

    def __init__(self, config: SpeculativeConfig | None):
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * (config.num_speculative_tokens if config else 0)

    def record(self, num_checked: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_checked
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def stats_fields(self) -> dict[str, int | list[int]]:
        """The counts under SchedulerStats' names."""
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position)}

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a step with drafts gains on average: the accepted drafts plus the model's own."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
