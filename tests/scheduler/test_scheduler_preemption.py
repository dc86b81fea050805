"""Preemption by recompute when KV blocks run out."""
import logging

from common.protocol import FinishReason
from tests.scheduler.fake_worker import (RunResult, assert_no_leaked_blocks, deterministic_sample, make_request,
                                         make_scheduler, record, run_to_completion, step)

A_PROMPT = list(range(100, 115))
B_PROMPT = list(range(200, 215))


def reference_tokens(requests, vocab_size: int = 1000, **config) -> RunResult:
    """The same requests on a cache big enough that nothing is preempted."""
    scheduler, worker = make_scheduler(num_blocks=200, sample_fn=deterministic_sample(vocab_size), **config)
    for request in requests:
        scheduler.add_request(request)
    result = run_to_completion(scheduler, worker)
    assert scheduler.stats().num_preemptions == 0
    return result


def test_most_recently_admitted_request_is_preempted_and_waits_at_the_front(caplog):
    requests = [make_request("a", A_PROMPT, max_tokens=12, ignore_eos=True),
                make_request("b", B_PROMPT, max_tokens=12, ignore_eos=True),
                make_request("c", [1, 2, 3], max_tokens=4, ignore_eos=True)]
    scheduler, worker = make_scheduler(sample_fn=deterministic_sample())  # 10 usable blocks of 4
    scheduler.add_request(requests[0])
    scheduler.add_request(requests[1])
    result = RunResult()
    plan = scheduler.schedule()
    assert [n.block_ids for n in plan.new_requests] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    record(result, scheduler.update(plan, worker.execute(plan)))
    step(scheduler, worker, result)
    plan = scheduler.schedule()  # both cross into a fifth block: the last two free ones
    assert [(c.request_id, c.new_block_ids) for c in plan.cached_requests] == [("a", [9]), ("b", [10])]
    record(result, scheduler.update(plan, worker.execute(plan)))
    scheduler.add_request(requests[2])  # no block left for it: it waits
    for _ in range(3):
        step(scheduler, worker, result)
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    b = scheduler.running[1]
    b_tokens_before = list(b.all_token_ids)

    with caplog.at_level(logging.WARNING, logger="scheduler.scheduler"):
        plan = scheduler.schedule()  # "a" needs a sixth block
    assert plan.num_scheduled_tokens == {"a": 1}
    assert [(c.request_id, c.new_block_ids) for c in plan.cached_requests] == [("a", [10])]  # b's tail block
    assert plan.new_requests == []  # no admission in a step that preempted
    assert plan.finished_request_ids == ["b"]  # the worker drops b's state
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert b.num_computed_tokens == 0 and b.all_token_ids == b_tokens_before  # generated tokens kept
    assert scheduler.kv_cache_manager.get_block_ids("b") == []
    assert scheduler.kv_cache_manager.block_pool.free_block_queue.block_ids() == [8, 7, 6, 5]
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "b" in warning.getMessage() and "total preemptions: 1" in warning.getMessage()
    assert scheduler.stats().num_preemptions == 1
    record(result, scheduler.update(plan, worker.execute(plan)))

    readmitted = None
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        for new in plan.new_requests:
            if new.request_id == "b":
                readmitted = new
        record(result, scheduler.update(plan, worker.execute(plan)))
    # Back with its prompt and the 6 tokens generated before, served partly from its own cached blocks.
    assert readmitted.token_ids == b_tokens_before and readmitted.num_prompt_tokens == 15
    assert readmitted.num_computed_tokens == 12 and readmitted.block_ids[:3] == [5, 6, 7]
    assert {r: len(t) for r, t in result.tokens.items()} == {"a": 12, "b": 12, "c": 4}
    assert result.finish_reasons == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH, "c": FinishReason.LENGTH}
    assert result.tokens == reference_tokens(requests).tokens
    assert_no_leaked_blocks(scheduler)


def test_no_waiting_request_is_admitted_in_a_step_that_preempted():
    # Prefix caching off, so the victim would fit again right away if admissions were allowed:
    # its first chunk only needs the blocks the leftover budget covers.
    scheduler, worker = make_scheduler(max_num_batched_tokens=10, enable_prefix_caching=False,
                                       sample_fn=deterministic_sample())
    for name, base, length in (("a", 100, 8), ("b", 200, 8), ("c", 300, 11)):
        scheduler.add_request(make_request(name, list(range(base, base + length)), max_tokens=20, ignore_eos=True))
    result = RunResult()
    while scheduler.stats().num_preemptions == 0:
        plan = scheduler.schedule()
        if scheduler.stats().num_preemptions:
            break
        record(result, scheduler.update(plan, worker.execute(plan)))
    assert plan.finished_request_ids == ["c"] and plan.new_requests == []
    assert set(plan.num_scheduled_tokens) == {"a", "b"}
    budget_left = 10 - sum(plan.num_scheduled_tokens.values())
    victim = scheduler.waiting.peek()
    assert victim.request_id == "c"
    chunk_blocks = -(-min(budget_left, victim.num_tokens) // 4)
    assert scheduler.kv_cache_manager.num_free_blocks >= chunk_blocks > 0  # it would have fit
    record(result, scheduler.update(plan, worker.execute(plan)))

    plan = scheduler.schedule()  # next step: the victim comes back first
    assert [n.request_id for n in plan.new_requests] == ["c"]
    record(result, scheduler.update(plan, worker.execute(plan)))
    run_to_completion(scheduler, worker, result=result)
    assert {r: len(t) for r, t in result.tokens.items()} == {"a": 20, "b": 20, "c": 20}
    assert result.tokens == reference_tokens(
        [make_request(n, list(range(b, b + l)), max_tokens=20, ignore_eos=True)
         for n, b, l in (("a", 100, 8), ("b", 200, 8), ("c", 300, 11))],
        max_num_batched_tokens=10, enable_prefix_caching=False).tokens
    assert_no_leaked_blocks(scheduler)


def test_the_most_recent_request_preempts_itself_when_it_needs_a_block():
    scheduler, worker = make_scheduler(max_num_batched_tokens=6, enable_prefix_caching=False)
    for name, base, length in (("a", 100, 4), ("b", 200, 3), ("c", 300, 12)):
        scheduler.add_request(make_request(name, list(range(base, base + length)), max_tokens=20, ignore_eos=True))
    result = RunResult()
    while True:
        plan = scheduler.schedule()
        if scheduler.stats().num_preemptions:
            break
        record(result, scheduler.update(plan, worker.execute(plan)))
    assert plan.num_scheduled_tokens == {"a": 1, "b": 1}  # a and b ran; c gave up its own blocks
    assert plan.finished_request_ids == ["c"]
    assert [r.request_id for r in scheduler.running] == ["a", "b"]
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    record(result, scheduler.update(plan, worker.execute(plan)))
    run_to_completion(scheduler, worker, result=result)
    assert {r: len(t) for r, t in result.tokens.items()} == {"a": 20, "b": 20, "c": 20}
    assert_no_leaked_blocks(scheduler)


def test_outputs_do_not_depend_on_preemption():
    requests = [make_request(f"r{i}", [(7 * i + j) % 50 for j in range(3 + 2 * i)], max_tokens=6 + i,
                             min_tokens=2)
                for i in range(8)]
    scheduler, worker = make_scheduler(num_blocks=9, max_model_len=32, sample_fn=deterministic_sample(50),
                                       max_num_batched_tokens=12)
    for request in requests:
        scheduler.add_request(request)
    result = run_to_completion(scheduler, worker)
    assert scheduler.stats().num_preemptions > 0
    reference = reference_tokens(requests, vocab_size=50, max_model_len=32, max_num_batched_tokens=12)
    assert result.tokens == reference.tokens
    assert result.finish_reasons == reference.finish_reasons
    assert_no_leaked_blocks(scheduler)
