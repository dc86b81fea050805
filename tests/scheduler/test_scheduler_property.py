"""Random add / step / abort sequences against the block-pool invariants.

The fake worker emits random tokens (EOS among them) and checks, before each
sample, that the KV slots of the whole sequence hold the right tokens, so a
wrongly shared, overwritten or mis-hit block fails even when the bookkeeping
looks consistent.
"""
import random
from collections import Counter

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from common.errors import InvalidRequestError
from common.protocol import FinishReason, parent_request_id
from scheduler.kv_cache_manager import cdiv
from scheduler.request import RequestStatus
from tests.scheduler.fake_worker import (FakeWorker, RunResult, assert_no_leaked_blocks, deterministic_sample,
                                         make_request, make_scheduler, record, step)

EOS = 0
VOCAB = 6  # tiny, so random prompts and outputs share prefixes often

# Prompts start with one of a few shared prefixes, so prefix hits are common.
PREFIXES = ([1, 2, 3, 4], [1, 2, 3, 4, 5, 1, 2, 3], [1, 2, 3, 4, 5, 1, 2, 3, 4, 4], [5, 5, 5, 5, 5, 5], [])
prompts = st.builds(lambda prefix, tail: prefix + tail, st.sampled_from(PREFIXES),
                    st.lists(st.integers(0, VOCAB - 1), max_size=6))
add_op = st.tuples(st.just("add"), st.integers(0, 7),  # request id number (ids get reused)
                   prompts,
                   st.integers(1, 16),  # max_tokens
                   st.integers(0, 3),  # min_tokens
                   st.booleans(),  # ignore_eos
                   st.integers(0, 2),  # priority
                   st.sampled_from([None, None, "s1"]),  # cache salt
                   st.sampled_from([1, 1, 1, 2, 3]))  # n: samples fork from one prefill
step_op = st.tuples(st.just("step"), st.integers(1, 4),  # how many steps
                    st.none() | st.none() | st.integers(0, 7))  # maybe abort one id in the middle of the first
abort_op = st.tuples(st.just("abort"), st.integers(0, 7))
reset_op = st.tuples(st.just("reset"))
ops_strategy = st.lists(st.one_of(add_op, add_op, add_op, step_op, step_op, abort_op, reset_op),
                        min_size=8, max_size=80)


def check_invariants(scheduler) -> None:
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    holders: Counter[int] = Counter()
    for request_id, blocks in kv.req_to_blocks.items():
        ids = [b.block_id for b in blocks]
        assert len(set(ids)) == len(ids), f"{request_id} holds a block twice"
        assert 0 not in ids
        holders.update(ids)
    running_ids = {r.request_id for r in scheduler.running}
    assert set(kv.req_to_blocks) == running_ids  # waiting and finished requests hold nothing
    free = set(pool.free_block_queue.block_ids())
    assert len(free) == pool.num_free_blocks
    assert pool.num_free_blocks + sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0) == pool.num_usable_blocks
    assert pool.null_block.ref_cnt == 0 and 0 not in free
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders[block.block_id], f"{block} held by {holders[block.block_id]}"
        assert (block.ref_cnt == 0) == (block.block_id in free)
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash
    for block in pool.partial_index.blocks():  # partial hits only copy from registered blocks
        assert block.block_hash is not None and pool.cached_block_hash_to_block[block.block_hash] is block
    # A block held by two requests is a full, computed block at the same
    # position of both, holding the same tokens: a cached prefix block, or a
    # prompt block a sample forked from (read-only either way).
    by_id = {r.request_id: r for r in scheduler.running}
    contents: dict[int, tuple[int, list[int]]] = {}
    for request_id, blocks in kv.req_to_blocks.items():
        request = by_id[request_id]
        assert len(blocks) == cdiv(request.num_computed_tokens, kv.block_size)
        for index, block in enumerate(blocks):
            if block.ref_cnt > 1:
                assert (index + 1) * kv.block_size <= request.num_computed_tokens
                tokens = request.all_token_ids[index * kv.block_size:(index + 1) * kv.block_size]
                assert contents.setdefault(block.block_id, (index, tokens)) == (index, tokens)
                if block.block_hash is not None:
                    assert pool.cached_block_hash_to_block[block.block_hash] is block
                    assert request.block_hashes[index] == block.block_hash
    assert len(scheduler.running) <= scheduler.max_num_seqs
    for request in scheduler.waiting:
        assert request.num_computed_tokens == 0 and request.status is not RequestStatus.RUNNING


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(5, 16), block_size=st.sampled_from([1, 2, 4, 4]), budget=st.integers(1, 24),
       max_num_seqs=st.integers(1, 6), caching=st.booleans(), max_model_len=st.integers(8, 48),
       seed=st.integers(0, 2**16), ops=ops_strategy)
def test_random_workloads_keep_the_block_pool_consistent(num_blocks, block_size, budget, max_num_seqs, caching,
                                                         max_model_len, seed, ops):
    scheduler, _ = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
                                  eos_token_ids=(EOS,), max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                  enable_prefix_caching=caching)
    worker = FakeWorker(num_blocks, block_size, vocab_size=VOCAB, seed=seed)
    result = RunResult()
    submitted = {}  # live request id -> EngineRequest
    num_accepted = 0

    def do_step(abort_mid_step=None):
        plan = scheduler.schedule()
        if plan is None:
            assert not scheduler.has_unfinished_requests()
            return
        assert 0 < sum(plan.num_scheduled_tokens.values()) <= budget
        assert all(n > 0 for n in plan.num_scheduled_tokens.values())
        check_invariants(scheduler)
        if abort_mid_step is not None:
            record(result, scheduler.abort_requests([f"r{abort_mid_step}"]))
        record(result, scheduler.update(plan, worker.execute(plan)))
        check_invariants(scheduler)

    for op in ops:
        if op[0] == "add":
            _, number, prompt, max_tokens, min_tokens, ignore_eos, priority, salt, n = op
            request_id = f"r{number}"
            request = make_request(request_id, prompt, max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens),
                                   ignore_eos=ignore_eos, priority=priority, cache_salt=salt, n=n)
            in_flight = any(parent_request_id(r) == request_id for r in scheduler._requests)
            try:
                scheduler.add_request(request)
            except InvalidRequestError:
                assert in_flight or not prompt or len(prompt) + 1 > scheduler.max_model_len
                continue
            assert not in_flight
            for key in [k for k in result.tokens if parent_request_id(k) == request_id]:
                result.tokens.pop(key)
                result.finish_reasons.pop(key, None)
            submitted[request_id] = request
            num_accepted += 1
        elif op[0] == "step":
            do_step(op[2])
            for _ in range(op[1] - 1):
                do_step()
        elif op[0] == "abort":
            record(result, scheduler.abort_requests([f"r{op[1]}"]))
            check_invariants(scheduler)
        else:
            assert scheduler.reset_prefix_cache() == (scheduler.kv_cache_manager.block_pool.num_used_blocks == 0)
            check_invariants(scheduler)

    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        do_step()
    assert not scheduler.has_unfinished_requests()
    stats = scheduler.stats()
    event(f"preemptions: {min(stats.num_preemptions, 3)}+")
    event(f"prefix hits: {'yes' if stats.prefix_cache_hits else 'no'}")
    event(f"accepted requests: {min(num_accepted, 6)}+")
    event(f"stops: {'yes' if FinishReason.STOP in result.finish_reasons.values() else 'no'}")
    event(f"forked samples: {'yes' if any(out.index > 0 for out in result.outputs) else 'no'}")

    for key, reason in result.finish_reasons.items():
        tokens = result.tokens.get(key, [])
        params = submitted[parent_request_id(key)].sampling_params
        prompt_len = len(submitted[parent_request_id(key)].prompt_token_ids)
        assert len(tokens) <= params.max_tokens and prompt_len + len(tokens) <= scheduler.max_model_len
        if reason is FinishReason.LENGTH:
            assert len(tokens) == params.max_tokens or prompt_len + len(tokens) == scheduler.max_model_len
        elif reason is FinishReason.STOP:
            assert len(tokens) >= params.min_tokens and tokens[-1] == EOS and not params.ignore_eos
        if not params.ignore_eos:  # no EOS that counted went unnoticed
            assert EOS not in tokens[max(params.min_tokens - 1, 0):-1]
    assert_no_leaked_blocks(scheduler)


def test_tight_cache_stress_matches_an_unconstrained_run():
    """Many requests with shared prefixes arriving over time on a cache that
    forces preemptions: invariants hold after every step, and every request's
    tokens equal those of a run with ample memory and no chunking (the fake
    model's next token depends only on the sequence so far)."""
    preempting_seeds = [seed for seed in range(12) if stress_run(seed) > 0]
    assert len(preempting_seeds) >= 8  # the scenario really exercises preemption


def stress_run(seed: int) -> int:
    rng = random.Random(seed)
    block_size = rng.choice([2, 4])
    num_blocks = rng.randint(8, 14)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 10))] for _ in range(3)]
    requests = []
    for i in range(24):
        prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
        requests.append((rng.randint(0, 40), make_request(
            f"q{i}", prompt, max_tokens=rng.randint(2, 14), min_tokens=rng.randint(0, 2),
            ignore_eos=rng.random() < 0.5, priority=rng.randint(0, 1))))
    max_model_len = (num_blocks - 1) * block_size
    tight_budget, tight_max_seqs = rng.randint(3, 16), rng.randint(3, 8)

    def run(tight: bool):
        scheduler, worker = make_scheduler(
            num_blocks=num_blocks if tight else 400, block_size=block_size, max_model_len=max_model_len,
            eos_token_ids=(EOS,), sample_fn=deterministic_sample(VOCAB),
            max_num_batched_tokens=tight_budget if tight else 4096, max_num_seqs=tight_max_seqs if tight else 64)
        result = RunResult()
        for step_index in range(5000):
            for arrival, request in requests:
                if arrival == step_index:
                    scheduler.add_request(request)
            if step_index > 40 and not scheduler.has_unfinished_requests():
                break
            step(scheduler, worker, result)
            check_invariants(scheduler)
        assert_no_leaked_blocks(scheduler)
        return result, scheduler.stats()

    (tight, stats), (reference, _) = run(tight=True), run(tight=False)
    assert len(tight.finish_reasons) == len(requests), f"seed {seed}"
    assert tight.tokens == reference.tokens and tight.finish_reasons == reference.finish_reasons, f"seed {seed}"
    assert stats.prefix_cache_hits > 0, f"seed {seed}"
    return stats.num_preemptions
