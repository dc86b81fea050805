"""A torch-free stand-in for the worker, for driving the scheduler in tests.

It follows the worker's side of the protocol exactly: it keeps per-request
state between steps, applies NewRequestData / CachedRequestData, drops the
state of finished ids, and samples for a request when its scheduled chunk
reaches the end of the tokens it knows (appending the sampled token itself).

It also models the KV cache: every computed token "writes" to its slot
(block_id * block_size + offset) a key of the whole prefix up to it (real KV
depends on every earlier token), the plan's `kv_copies` copy slots, and
before sampling it checks that every position of the sequence reads back its
prefix's key through the block table. A block shared wrongly, overwritten
while in use, or a bad prefix hit (whole or partial) fails here, like it
would corrupt attention in the real worker.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from common.protocol import EngineRequest, RequestOutput, StepPlan, StepResult, sample_request_id
from common.sampling_params import SamplingParams

SampleFn = Callable[[str, list[int]], int]  # (request_id, token ids so far) -> next token
ProposeFn = Callable[[str, list[int]], list[int]]  # (request_id, token ids so far) -> drafts


@dataclass
class FakeRequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int


class FakeWorker:
    def __init__(self, num_blocks: int, block_size: int, sample_fn: SampleFn | None = None,
                 vocab_size: int = 1000, seed: int = 0, propose_fn: ProposeFn | None = None):
        """`propose_fn`: speculative decoding's drafts, proposed after every step a request
        samples in when the plan asks; a step's drafts are checked like the real worker does
        (each position samples as without them, the agreeing prefix is accepted)."""
        self.propose_fn = propose_fn
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size
        self.sample_fn = sample_fn or (lambda request_id, token_ids: self.rng.randrange(self.vocab_size))
        self.requests: dict[str, FakeRequestState] = {}
        self.kv: list[int | None] = [None] * (num_blocks * block_size)  # prefix key stored in each slot
        self.num_steps = 0
        self.num_computed_tokens_total = 0

    def execute(self, plan: StepPlan) -> StepResult:
        for src, dst, num_tokens in plan.kv_copies:  # before anything this step writes
            assert 0 < num_tokens <= self.block_size and src != dst, (src, dst, num_tokens)
            for offset in range(num_tokens):
                assert self.kv[src * self.block_size + offset] is not None, "copied an unwritten slot"
                self.kv[dst * self.block_size + offset] = self.kv[src * self.block_size + offset]
        for request_id in plan.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in plan.new_requests:
            self.requests[new.request_id] = FakeRequestState(
                list(new.token_ids), new.num_prompt_tokens, list(new.block_ids), new.num_computed_tokens)
        for cached in plan.cached_requests:
            state = self.requests[cached.request_id]
            assert cached.num_computed_tokens == state.num_computed_tokens, (
                f"{cached.request_id}: plan says {cached.num_computed_tokens} computed, worker has "
                f"{state.num_computed_tokens}")
            if cached.num_blocks_kept >= 0:
                del state.block_ids[cached.num_blocks_kept:]
            state.block_ids.extend(cached.new_block_ids)

        sampled_ids, sampled_tokens = [], []
        accepted_ids: dict[str, list[int]] = {}
        proposals: dict[str, list[int]] = {}
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            state = self.requests[request_id]
            drafts = plan.draft_token_ids.get(request_id, [])
            assert num_tokens >= 1
            start, end = state.num_computed_tokens, state.num_computed_tokens + num_tokens
            if drafts:
                assert end == len(state.token_ids) + len(drafts), f"{request_id}: drafts not after one decode token"
            else:
                assert end <= len(state.token_ids), f"{request_id}: scheduled past the known tokens"
            assert len(state.block_ids) * self.block_size >= end, f"{request_id}: too few blocks"
            assert 0 not in state.block_ids, "the null block was handed out"
            assert all(0 < b < self.num_blocks for b in state.block_ids)
            keys = prefix_keys(state.token_ids + drafts)
            for position in range(start, end):
                self.kv[self._slot(state, position)] = keys[position]
            state.num_computed_tokens = end
            self.num_computed_tokens_total += num_tokens
            if end >= len(state.token_ids):
                accepted = []
                for draft in drafts:
                    if self.sample_fn(request_id, list(state.token_ids)) != draft:
                        break
                    accepted.append(draft)
                    state.token_ids.append(draft)
                if drafts:
                    state.num_computed_tokens -= len(drafts) - len(accepted)
                    accepted_ids[request_id] = accepted
                self._check_kv(request_id, state)
                token = self.sample_fn(request_id, list(state.token_ids))
                state.token_ids.append(token)
                sampled_ids.append(request_id)
                sampled_tokens.append(token)
                if plan.speculate and self.propose_fn is not None:
                    proposed = self.propose_fn(request_id, list(state.token_ids))
                    if proposed:
                        proposals[request_id] = proposed
        self.num_steps += 1
        return StepResult(step_id=plan.step_id, request_ids=sampled_ids, sampled_token_ids=sampled_tokens,
                          accepted_draft_ids=accepted_ids, proposals=proposals)

    def _slot(self, state: FakeRequestState, position: int) -> int:
        return state.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def _check_kv(self, request_id: str, state: FakeRequestState) -> None:
        """What attention would read back for the whole sequence."""
        keys = prefix_keys(state.token_ids)
        for position in range(state.num_computed_tokens):
            stored = self.kv[self._slot(state, position)]
            assert stored == keys[position], (
                f"{request_id}: KV at position {position} is not that of token {state.token_ids[position]} "
                f"after its own prefix")


def prefix_keys(token_ids: list[int]) -> list[int]:
    """Per position a key of every token up to it: what the KV written there depends on."""
    keys, key = [], 0
    for token in token_ids:
        key = hash((key, token))
        keys.append(key)
    return keys


def make_request(request_id: str, prompt: list[int], *, max_tokens: int | None = 16, priority: int = 0,
                 cache_salt: str | None = None, **params) -> EngineRequest:
    return EngineRequest(request_id=request_id, prompt_token_ids=list(prompt),
                         sampling_params=SamplingParams(max_tokens=max_tokens, **params),
                         priority=priority, cache_salt=cache_salt)


@dataclass
class RunResult:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict = field(default_factory=dict)
    outputs: list[RequestOutput] = field(default_factory=list)
    plans: list[StepPlan] = field(default_factory=list)


def step(scheduler, worker: FakeWorker, result: RunResult | None = None) -> list[RequestOutput]:
    """One schedule -> execute -> update round; [] when nothing was scheduled."""
    plan = scheduler.schedule()
    if plan is None:
        return []
    outputs = scheduler.update(plan, worker.execute(plan))
    if result is not None:
        result.plans.append(plan)
        record(result, outputs)
    return outputs


def record(result: RunResult, outputs: list[RequestOutput]) -> None:
    """Tokens and finish reasons by request id (sample i > 0 of a request with
    several: by its sample id)."""
    for out in outputs:
        result.outputs.append(out)
        key = out.request_id if out.index == 0 else sample_request_id(out.request_id, out.index)
        result.tokens.setdefault(key, []).extend(out.new_token_ids)
        if out.finish_reason is not None:
            assert key not in result.finish_reasons, f"{key} finished twice"
            result.finish_reasons[key] = out.finish_reason


def run_to_completion(scheduler, worker: FakeWorker, max_steps: int = 10_000,
                      result: RunResult | None = None) -> RunResult:
    result = result or RunResult()
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return result
        step(scheduler, worker, result)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def assert_no_leaked_blocks(scheduler) -> None:
    """Every block is free (ref count 0) and no request holds a block table."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    assert kv.req_to_blocks == {}
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert sorted(pool.free_block_queue.block_ids()) == list(range(1, pool.num_blocks))


def deterministic_sample(vocab_size: int = 1000) -> SampleFn:
    """A 'model' whose next token depends only on the tokens so far, so outputs
    do not depend on batching, chunking, preemption or prefix hits."""
    def sample(request_id: str, token_ids: list[int]) -> int:
        value = 17
        for token in token_ids:
            value = (value * 31 + token) % 1_000_003
        return value % vocab_size
    return sample


def make_scheduler(num_blocks: int = 11, block_size: int = 4, max_model_len: int = 40,
                   eos_token_ids: tuple[int, ...] = (2,), sample_fn: SampleFn | None = None,
                   propose_fn: ProposeFn | None = None, **config):
    """A Scheduler (11 blocks of 4 tokens by default) and a FakeWorker sized alike."""
    from common.config import EngineConfig
    from scheduler.scheduler import Scheduler
    engine_config = EngineConfig(block_size=block_size, device="cpu", **config)
    scheduler = Scheduler(engine_config, num_blocks=num_blocks, max_model_len=max_model_len,
                          eos_token_ids=list(eos_token_ids))
    return scheduler, FakeWorker(num_blocks, block_size, sample_fn=sample_fn, propose_fn=propose_fn)
