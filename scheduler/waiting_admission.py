"""Admission of waiting requests into a step: queue order, no overtaking, within the step's token
budget, sequence slots, KV blocks and LoRA slots; whole-block prefix hits and a partial hit (the
shared start of the next block, copied) count as computed. Part of `Scheduler.schedule`."""
from __future__ import annotations

from scheduler.block_pool import KVBlock
from scheduler.lora_admission import exceeds_lora_slots
from scheduler.request import Request, RequestStatus
from scheduler.speculation import lookahead_slots


def admit_waiting(scheduler, budget: int, scheduled: list[tuple[Request, int, list[int]]],
                  lookahead: int) -> None:
    """Admit a `scheduler.scheduler.Scheduler`'s waiting requests while they fit; stop at the first
    that does not, or whose next uncached block a running request computes right now (SGLang's
    in-batch prefix sharing: cached next step). Admitted requests join its running list and `scheduled`."""
    kv = scheduler.kv_cache_manager
    in_flight = kv.uncached_block_hashes(scheduler.running) if kv.enable_caching else set()
    while scheduler.waiting and budget > 0 and len(scheduler.running) < scheduler.max_num_seqs:
        request = scheduler.waiting.peek()
        hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
        if (in_flight and kv.next_block_in_flight(request, len(hit_blocks), in_flight)) or (
                scheduler.config.enable_lora
                and exceeds_lora_slots(scheduler.running, request, scheduler.config.max_loras)):
            break
        admitted = _allocate(scheduler, request, hit_blocks, num_hit_tokens, budget, lookahead)
        if admitted is None:
            break
        num_hit_tokens, num_new, new_block_ids = admitted
        scheduler.waiting.pop()
        kv.record_prefix_lookup(request.num_tokens, num_hit_tokens)
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_hit_tokens
        request.status = RequestStatus.RUNNING
        scheduler.running.append(request)
        if kv.enable_caching:
            in_flight |= kv.uncached_block_hashes([request])
        # A reused id: this plan's NewRequestData replaces the old state anyway,
        # and the worker must not drop the new one.
        scheduler._finished_ids.pop(request.request_id, None)
        scheduled.append((request, num_new, new_block_ids))
        budget -= num_new


def _allocate(scheduler, request: Request, hit_blocks: list[KVBlock], num_hit_tokens: int, budget: int,
              lookahead: int) -> tuple[int, int, list[int]] | None:
    """(hit tokens, new tokens, block ids) for a request being admitted, or None: it waits. A
    partial hit is copied into the first fresh block (allocate_slots queues the copy for the plan)
    unless its source, held beside that block, leaves too few: then those tokens are recomputed."""
    kv = scheduler.kv_cache_manager
    partial = kv.get_partial_hit(request, len(hit_blocks))
    for partial in (partial, None) if partial else (None,):
        num_hits = num_hit_tokens + (partial[1] if partial else 0)
        num_new = min(request.num_tokens - num_hits, budget)
        if scheduler.whole_prompts and num_new < request.num_tokens:
            return None  # waits for a step with room for all of it
        ahead = lookahead_slots(request, num_hits, num_new, lookahead, scheduler.max_model_len)
        new_block_ids = kv.allocate_slots(request, num_new + ahead, hit_blocks, partial)
        if new_block_ids is not None:
            return num_hits, num_new, new_block_ids
    return None
