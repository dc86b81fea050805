"""Continuous batching with a token budget (vLLM v1 style, no phases).

Each step serves running requests in admission order (one decode token, or the next prefill
chunk), then admits waiting requests, all within `max_num_batched_tokens` tokens and
`max_num_seqs` running requests. When a running request cannot get blocks, the most recently
admitted running request is preempted by recompute. A request with several samples (n > 1, best_of) prefills its prompt
once and forks (`scheduler.sample_group`); drafts ride on decodes (`scheduler.speculation`); a
pooling request ends with its prompt; LoRA adapters fit `scheduler.lora_admission`; waiting requests
join by `scheduler.waiting_admission`. No torch.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

from common.config import EngineConfig
from common.errors import InvalidRequestError
from common.pooling_params import PoolerInfo
from common.protocol import (CachedRequestData, EngineRequest, FinishReason, NewRequestData, RequestOutput,
                             ResumedSample, StepPlan, StepResult, TokenLogprobs, parent_request_id,
                             sample_request_id)
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.lora_admission import check_lora_request
from scheduler.queues import WaitingQueue
from scheduler.request import Request, RequestStatus
from scheduler.request_checks import check_new_request, resolve_pooling, servable_max_model_len
from scheduler.resumption import resumed_samples
from scheduler.sample_group import SampleGroup
from scheduler.scheduler_stats import SchedulerStats, scheduler_stats
from scheduler.speculation import (SpecDecodeStats, drafts_to_check, lookahead_slots, roll_back_rejected,
                                   speculating)
from scheduler.waiting_admission import admit_waiting

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int, eos_token_ids: list[int],
                 vocab_size: int | None = None, sliding_window: int = 0, pooler: PoolerInfo | None = None):
        """`vocab_size`: prompt and stop/bias ids must lie in it; `pooler`: a pooling model's;
        `sliding_window`: every layer's window, when all have one (all three the worker's)."""
        self.config = config
        self.vocab_size = vocab_size
        self.pooler = pooler
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.resolved_max_num_batched_tokens()  # torch-free
        self.speculative_config = config.speculative_config
        self.max_model_len = servable_max_model_len(max_model_len, num_blocks, config.block_size, sliding_window,
                                                    config.max_step_tokens())
        self.eos_token_ids = frozenset(eos_token_ids)
        self.whole_prompts = pooler is not None and pooler.bidirectional  # an encoder: no chunks, no prefix hits
        self.kv_cache_manager = KVCacheManager(num_blocks, self.block_size,
                                               config.enable_prefix_caching and not self.whole_prompts, sliding_window)

        self._requests: dict[str, Request] = {}  # every unfinished request (each sample of one)
        self._groups: dict[str, SampleGroup] = {}  # requests with several samples, by request id
        self.waiting = WaitingQueue()
        self.running: list[Request] = []  # admission order; the last one is preempted first
        self._finished_ids: dict[str, None] = {}  # for the next plan (ordered set)
        self._next_arrival = 0
        self._next_step_id = 0
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.spec_stats = SpecDecodeStats(self.speculative_config)

    # --- requests in and out ----------------------------------------------
    def add_request(self, engine_request: EngineRequest) -> None:
        """Queue a request; raises InvalidRequestError instead of truncating."""
        request_id = engine_request.request_id
        check_new_request(engine_request, self.vocab_size, self.max_model_len, self.config.max_logprobs)
        check_lora_request(engine_request, self.config)
        engine_request = resolve_pooling(engine_request, self.pooler, self.max_num_batched_tokens)
        params = engine_request.sampling_params
        num_samples = params.num_samples
        ids = [request_id] + [sample_request_id(request_id, i) for i in range(num_samples if num_samples > 1 else 0)]
        if any(i in self._requests or i in self._groups or self._is_future_sample(i) for i in ids):
            raise InvalidRequestError(f"Request id {request_id!r} is already in flight", param="request_id")
        resumed = resumed_samples(engine_request, self.max_model_len, self.vocab_size)
        if resumed:
            self._add_resumed(engine_request, resumed)
            return
        request = self._new_request(engine_request, 0, self._next_arrival)
        self._next_arrival += 1
        if num_samples > 1:
            self._groups[request_id] = SampleGroup(engine_request, num_samples, {0: request})
        self._requests[request.request_id] = request
        self.waiting.push(request)

    def _add_resumed(self, engine_request: EngineRequest, resumed: dict[int, ResumedSample]) -> None:
        """Queue a resubmitted request's unfinished samples, each with its tokens so far."""
        num_samples = engine_request.sampling_params.num_samples
        samples: dict[int, Request] = {}
        for index in range(num_samples):
            sample = resumed.get(index)
            if sample is None or not sample.finished:
                samples[index] = self._new_request(engine_request, index, self._next_arrival,
                                                   sample.output_token_ids if sample is not None else [])
        self._next_arrival += 1
        if num_samples > 1:
            self._groups[engine_request.request_id] = SampleGroup.resumed(engine_request, num_samples, samples)
        for request in samples.values():
            self._requests[request.request_id] = request
            self.waiting.push(request)

    def _is_future_sample(self, request_id: str) -> bool:
        """Whether the id is that of a sample an in-flight request has yet to fork."""
        group = self._groups.get(parent_request_id(request_id))
        return group is not None and any(request_id == sample_request_id(group.request_id, i)
                                         for i in range(group.num_samples))

    def client_request_id(self, request_id: str) -> str:
        """The client's id for a live request or sample (the id itself when unknown); looked up,
        never parsed: a client's own id may look like a sample id ("job#1")."""
        request = self._requests.get(request_id)
        return request.external_id if request is not None else request_id

    def _new_request(self, engine_request: EngineRequest, index: int, arrival: int, outputs: list[int] = ()) -> Request:
        return Request(engine_request, arrival, self.max_model_len, self.block_size,
                       self.kv_cache_manager.enable_caching, index, outputs)

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Finish requests as ABORT (unknown or finished ids are ignored); a request id ends all its samples."""
        request_ids = [request_ids] if isinstance(request_ids, str) else request_ids
        outputs = []
        for request_id in request_ids:
            group = self._groups.get(request_id)
            if group is not None:
                group.drop_unforked()
                targets = group.live_samples()
            else:
                targets = [self._requests[request_id]] if request_id in self._requests else []
            for request in targets:
                if request.status is RequestStatus.RUNNING:
                    self.running.remove(request)
                else:
                    self.waiting.remove(request)
                self._finish(request, FinishReason.ABORT)
                outputs.append(self._output(request, []))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # --- one step -----------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """Plan the next step, or None when no request has work."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int, list[int]]] = []  # (request, tokens, blocks added)
        drafts: dict[str, list[int]] = {}
        preempted = False
        speculate = speculating(self.speculative_config, len(self.running))
        lookahead = self.speculative_config.lookahead_slots if speculate else 0

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:  # its sampled token is not back yet (schedule called twice)
                index += 1
                continue
            checked = drafts_to_check(request, budget, self.max_model_len) if speculate and num_new == 1 else []
            # A step that samples gives a draft model room to run ahead (its KV past the checked tokens).
            ahead = lookahead_slots(request, request.num_computed_tokens, num_new + len(checked), lookahead,
                                    self.max_model_len)
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new + len(checked) + ahead)
            if new_block_ids is None and (checked or ahead):  # drafts never cost another request its place
                checked, ahead = [], 0
                new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            while new_block_ids is None:
                # Victims come from the tail, i.e. requests not yet scheduled in this step.
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_block_ids is None:
                break
            if checked:
                drafts[request.request_id] = checked
                num_new += len(checked)
            request.spec_token_ids = []
            scheduled.append((request, num_new, new_block_ids))
            budget -= num_new
            index += 1

        # Admitting right after a preemption would only thrash the cache.
        if not preempted:
            admit_waiting(self, budget, scheduled, lookahead)
        if not scheduled:
            return None  # pending finished ids go out with the next plan

        new_requests, cached_requests, num_scheduled_tokens = [], [], {}
        for request, num_new, new_block_ids in scheduled:
            if request.sent_to_worker:
                kept = -1
                if request.blocks_trimmed:
                    kept = len(self.kv_cache_manager.req_to_blocks[request.request_id]) - len(new_block_ids)
                cached_requests.append(CachedRequestData(
                    request_id=request.request_id, new_block_ids=new_block_ids,
                    num_computed_tokens=request.num_computed_tokens, num_blocks_kept=kept))
            else:
                # All its blocks: a forked sample arrives holding its shared prompt blocks.
                new_requests.append(NewRequestData(
                    request_id=request.request_id, token_ids=list(request.all_token_ids), images=request.images,
                    num_prompt_tokens=request.num_prompt_tokens, sampling_params=request.worker_params,
                    block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                    num_computed_tokens=request.num_computed_tokens, pooling_params=request.pooling_params, lora_request=request.lora_request))
                request.sent_to_worker = True
            request.blocks_trimmed = False
            num_scheduled_tokens[request.request_id] = num_new
            # Advanced now, like vLLM: the next step continues after this chunk.
            request.num_computed_tokens += num_new
        plan = StepPlan(step_id=self._next_step_id, new_requests=new_requests, cached_requests=cached_requests,
                        num_scheduled_tokens=num_scheduled_tokens, finished_request_ids=list(self._finished_ids),
                        draft_token_ids=drafts, speculate=speculate, kv_copies=self.kv_cache_manager.take_copies())
        self._next_step_id += 1
        self._finished_ids.clear()
        return plan

    def _preempt(self, request: Request) -> None:
        """Recompute later: free the KV, keep the tokens, wait at the front."""
        self.kv_cache_manager.free(request)
        request.lose_kv()
        request.num_preemptions += 1
        self.num_preemptions += 1
        if request.sent_to_worker:
            self._finished_ids[request.request_id] = None  # the worker drops its state
            request.sent_to_worker = False
        self.waiting.push_front(request)
        logger.warning("Request %s was preempted by recompute: not enough free KV cache blocks "
                       "(total preemptions: %d). Performance may suffer; consider more KV cache memory "
                       "or lower max_num_seqs / max_num_batched_tokens.", request.request_id, self.num_preemptions)

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Apply a step's sampled tokens; return this step's outputs."""
        if result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} applied to plan {plan.step_id}")
        sampled = set(result.request_ids)
        for request_id, checked in plan.draft_token_ids.items():
            request = self._requests.get(request_id)
            if request is not None and request.status is RequestStatus.RUNNING and request_id in sampled:
                roll_back_rejected(self.kv_cache_manager, self.spec_stats, request, len(checked),
                                   len(result.accepted_draft_ids.get(request_id, ())))
        # The step's KV is computed now, so its newly full blocks can be shared.
        for request_id in plan.num_scheduled_tokens:
            request = self._requests.get(request_id)
            if request is not None and request.status is RequestStatus.RUNNING:
                self.kv_cache_manager.cache_blocks(request)
                self.kv_cache_manager.free_out_of_window(request)

        for request_id, chunk in result.prompt_logprobs.items():
            request = self._requests.get(request_id)
            if request is not None and request.status is RequestStatus.RUNNING:
                request.add_prompt_logprobs(chunk)

        outputs = []
        num_finished = 0
        for request_id, token_id in zip(result.request_ids, result.sampled_token_ids, strict=True):
            request = self._requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            accepted = result.accepted_draft_ids.get(request_id, [])
            if request.num_computed_tokens != request.num_tokens + len(accepted):
                logger.error("Ignoring a token sampled for %s, which has %d of %d tokens computed",
                             request_id, request.num_computed_tokens, request.num_tokens)
                continue
            if request.num_output_tokens == 0 and request.sample_index == 0:
                self.num_prompt_tokens += request.num_prompt_tokens  # once, however many samples
            new_token_ids, reason = request.append_until_stop(accepted + [token_id], self.eos_token_ids,
                                                              self.max_model_len)
            self.num_generation_tokens += len(new_token_ids)
            if request.num_output_tokens == len(new_token_ids) and request.sample_index == 0:
                group = self._groups.get(request.external_id)
                if group is not None and group.num_unforked:
                    self._fork(group, request)  # before a finish could free the prompt blocks
            prompt_logprobs = request.take_prompt_logprobs()
            if reason is not None:
                self._finish(request, reason)
                num_finished += 1
            else:
                request.spec_token_ids = result.proposals.get(request_id, [])
            logprobs = result.sampled_logprobs.get(request_id)
            if logprobs is not None:
                logprobs = (result.draft_logprobs.get(request_id, []) + [logprobs])[:len(new_token_ids)]
            outputs.append(self._output(request, new_token_ids, logprobs, prompt_logprobs))
        for request_id, embedding in result.pooled.items():  # pooling requests end with their prompt
            request = self._requests.get(request_id)
            if request is not None and request.status is RequestStatus.RUNNING:
                self.num_prompt_tokens += request.num_prompt_tokens
                self._finish(request, FinishReason.STOP)
                num_finished += 1
                outputs.append(self._output(request, [], embedding=embedding))
        if num_finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return outputs

    def _fork(self, group: SampleGroup, parent: Request) -> None:
        """Create the other samples now that the parent's prompt is computed. Each shares the parent's
        full prompt blocks and runs right away; when max_num_seqs is reached it waits instead (and
        finds the prompt in the prefix cache, if enabled, on admission)."""
        kv = self.kv_cache_manager
        for index in range(1, group.num_samples):
            child = self._new_request(group.engine_request, index, parent.arrival_order)
            child.num_cached_tokens = parent.num_cached_tokens  # usage reports the request's prompt once
            group.samples[index] = child
            self._requests[child.request_id] = child
            if len(self.running) < self.max_num_seqs:
                child.num_computed_tokens = kv.fork(parent, child)
                kv.record_prefix_lookup(child.num_tokens, child.num_computed_tokens)
                child.status = RequestStatus.RUNNING
                self.running.append(child)
            else:
                self.waiting.push(child)
        group.num_unforked = 0

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv_cache_manager.free(request)
        del self._requests[request.request_id]
        if request.sent_to_worker:
            self._finished_ids[request.request_id] = None
        group = self._groups.get(request.external_id)
        if group is not None:
            group.sample_finished(request)
            if group.finished:
                del self._groups[request.external_id]

    def _output(self, request: Request, new_token_ids: list[int], logprobs: list[TokenLogprobs] | None = None,
                prompt_logprobs: list[TokenLogprobs] | None = None, embedding=None) -> RequestOutput:
        group = self._groups.get(request.external_id)
        return RequestOutput(request_id=request.external_id, new_token_ids=new_token_ids,
                             finish_reason=request.finish_reason, num_prompt_tokens=request.num_prompt_tokens,
                             num_cached_tokens=request.num_cached_tokens or 0, index=request.sample_index,
                             more_samples=request.is_finished and group is not None and not group.finished,
                             logprobs=logprobs, prompt_logprobs=prompt_logprobs, attempt=request.attempt,
                             embedding=embedding)

    # --- introspection and control -------------------------------------------
    def stats(self) -> SchedulerStats:
        return scheduler_stats(self)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix; False (nothing changed) while requests hold blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def requeue_running(self) -> int:
        """The worker (and its KV cache) is gone: running requests go back to the front of the waiting queue
        in admission order, keeping their tokens, recomputed by the next worker (not preemptions). Returns how many."""
        moved = self.running
        for request in reversed(moved):  # push_front reverses, so the oldest ends first
            self.kv_cache_manager.free(request)
            request.lose_kv()
            request.sent_to_worker = False
            self.waiting.push_front(request)
        self.running = []
        self._finished_ids.clear()  # a fresh worker holds no request state to drop
        return len(moved)

    def reset_prefix_cache_for_new_worker(self) -> None:
        """A fresh worker's KV cache is empty: no cached hash may survive (call after `requeue_running`)."""
        if not self.kv_cache_manager.reset_prefix_cache():
            raise RuntimeError("KV blocks are still in use; call requeue_running first")
