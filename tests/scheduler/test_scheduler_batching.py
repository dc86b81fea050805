"""Token-budget scheduling: plans, chunked prefill, max_num_seqs, priorities,
prefix caching through the scheduler, stats."""
import os
import subprocess
import sys

from common.protocol import CachedRequestData, FinishReason, NewRequestData
from common.sampling_params import SamplingParams
from tests.scheduler.fake_worker import (assert_no_leaked_blocks, make_request, make_scheduler, run_to_completion,
                                         step)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def counting_sample(request_id, token_ids):
    return 1000 + len(token_ids)


def test_plan_sends_full_data_once_then_diffs_and_chunks_a_long_prompt():
    scheduler, worker = make_scheduler(max_num_batched_tokens=6, sample_fn=counting_sample)
    prompt = list(range(10, 24))  # 14 tokens
    scheduler.add_request(make_request("a", prompt, max_tokens=3))
    params = SamplingParams(max_tokens=3)

    plan = scheduler.schedule()
    assert plan.new_requests == [NewRequestData(request_id="a", token_ids=prompt, num_prompt_tokens=14,
                                                sampling_params=params, block_ids=[1, 2], num_computed_tokens=0)]
    assert plan.cached_requests == [] and plan.num_scheduled_tokens == {"a": 6}
    assert scheduler.update(plan, worker.execute(plan)) == []  # partial prefill: no output

    plan = scheduler.schedule()
    assert plan.new_requests == []
    assert plan.cached_requests == [CachedRequestData(request_id="a", new_block_ids=[3], num_computed_tokens=6)]
    assert plan.num_scheduled_tokens == {"a": 6}
    assert scheduler.update(plan, worker.execute(plan)) == []

    plan = scheduler.schedule()
    assert plan.cached_requests == [CachedRequestData(request_id="a", new_block_ids=[4], num_computed_tokens=12)]
    assert plan.num_scheduled_tokens == {"a": 2}
    [out] = scheduler.update(plan, worker.execute(plan))
    assert out.new_token_ids == [1014] and out.finish_reason is None
    assert out.num_prompt_tokens == 14 and out.num_cached_tokens == 0

    plan = scheduler.schedule()
    assert plan.cached_requests == [CachedRequestData(request_id="a", new_block_ids=[], num_computed_tokens=14)]
    assert plan.num_scheduled_tokens == {"a": 1}
    assert [o.new_token_ids for o in scheduler.update(plan, worker.execute(plan))] == [[1015]]

    plan = scheduler.schedule()
    [out] = scheduler.update(plan, worker.execute(plan))
    assert out.new_token_ids == [1016] and out.finish_reason is FinishReason.LENGTH
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule() is None  # nothing to run; "a" is reported with the next plan

    scheduler.add_request(make_request("b", [5]))
    assert scheduler.schedule().finished_request_ids == ["a"]
    scheduler.abort_requests(["b"])
    assert_no_leaked_blocks(scheduler)


def test_running_requests_come_first_and_waiting_ones_get_the_leftover_budget():
    scheduler, worker = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", list(range(10)), max_tokens=2))
    scheduler.add_request(make_request("b", list(range(100, 105)), max_tokens=2))

    outputs = step(scheduler, worker)
    assert outputs == []
    assert [r.request_id for r in scheduler.running] == ["a"]
    assert [r.request_id for r in scheduler.waiting] == ["b"]

    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == {"a": 2, "b": 5}
    assert [n.request_id for n in plan.new_requests] == ["b"]
    assert [c.request_id for c in plan.cached_requests] == ["a"]
    outputs = scheduler.update(plan, worker.execute(plan))
    assert [o.request_id for o in outputs] == ["a", "b"]

    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == {"a": 1, "b": 1}
    scheduler.update(plan, worker.execute(plan))
    assert not scheduler.has_unfinished_requests()
    assert_no_leaked_blocks(scheduler)


def test_a_decode_is_never_starved_by_a_long_prefill():
    scheduler, worker = make_scheduler(num_blocks=40, max_model_len=100, max_num_batched_tokens=8)
    scheduler.add_request(make_request("short", [1, 2, 3], max_tokens=10, ignore_eos=True))
    step(scheduler, worker)
    scheduler.add_request(make_request("long", list(range(100, 140)), max_tokens=2))
    for _ in range(5):
        plan = scheduler.schedule()
        assert plan.num_scheduled_tokens == {"short": 1, "long": 7}
        scheduler.update(plan, worker.execute(plan))
    run_to_completion(scheduler, worker)
    assert_no_leaked_blocks(scheduler)


def test_max_num_seqs_caps_the_running_set():
    scheduler, worker = make_scheduler(max_num_seqs=2)
    for name in ("a", "b", "c"):
        scheduler.add_request(make_request(name, [7, 8, 9, 10], max_tokens=2))
    plan = scheduler.schedule()
    assert list(plan.num_scheduled_tokens) == ["a", "b"]
    scheduler.update(plan, worker.execute(plan))
    assert scheduler.stats().num_running == 2 and scheduler.stats().num_waiting == 1
    plan = scheduler.schedule()
    assert list(plan.num_scheduled_tokens) == ["a", "b"]  # both finish here
    scheduler.update(plan, worker.execute(plan))
    plan = scheduler.schedule()
    assert list(plan.num_scheduled_tokens) == ["c"]
    assert plan.finished_request_ids == ["a", "b"]
    scheduler.update(plan, worker.execute(plan))
    run_to_completion(scheduler, worker)
    assert_no_leaked_blocks(scheduler)


def test_lower_priority_value_runs_first_ties_by_arrival():
    scheduler, worker = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("late-low", [1, 3], max_tokens=1, priority=5))
    scheduler.add_request(make_request("urgent-1", [1, 3], max_tokens=1, priority=0))
    scheduler.add_request(make_request("batch", [1, 3], max_tokens=1, priority=5))
    scheduler.add_request(make_request("urgent-2", [1, 3], max_tokens=1, priority=0))
    order = []
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        order += list(plan.num_scheduled_tokens)
        scheduler.update(plan, worker.execute(plan))
    assert order == ["urgent-1", "urgent-2", "late-low", "batch"]
    assert_no_leaked_blocks(scheduler)


def test_second_request_reuses_the_first_requests_prefix_blocks():
    scheduler, worker = make_scheduler()
    shared = list(range(50, 62))  # three full blocks
    scheduler.add_request(make_request("a", shared + [1, 2], max_tokens=1))
    plan = scheduler.schedule()
    assert plan.new_requests[0].block_ids == [1, 2, 3, 4]
    scheduler.update(plan, worker.execute(plan))  # a finishes; its blocks stay cached
    assert scheduler.kv_cache_manager.block_pool.free_block_queue.block_ids() == [5, 6, 7, 8, 9, 10, 4, 3, 2, 1]

    scheduler.add_request(make_request("b", shared + [7, 8, 9], max_tokens=1))
    plan = scheduler.schedule()
    [new] = plan.new_requests
    assert new.block_ids == [1, 2, 3, 5] and new.num_computed_tokens == 12
    assert plan.num_scheduled_tokens == {"b": 3}
    assert plan.finished_request_ids == ["a"]
    [out] = scheduler.update(plan, worker.execute(plan))
    assert out.num_cached_tokens == 12 and out.num_prompt_tokens == 15
    stats = scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (14 + 15, 12)
    assert_no_leaked_blocks(scheduler)


def test_a_request_waits_a_step_for_the_prefix_blocks_another_is_computing():
    scheduler, worker = make_scheduler(num_blocks=16)
    prompt = list(range(30, 44))
    scheduler.add_request(make_request("a", prompt, max_tokens=3))
    scheduler.add_request(make_request("b", prompt, max_tokens=3))
    scheduler.add_request(make_request("c", list(range(100, 114)), max_tokens=3))
    plan = scheduler.schedule()
    # b's first block is one a computes in this step: b waits (and c, behind it, too)
    # rather than compute the same blocks again.
    assert [n.request_id for n in plan.new_requests] == ["a"]
    scheduler.update(plan, worker.execute(plan))
    plan = scheduler.schedule()
    new = {n.request_id: n for n in plan.new_requests}
    assert new["b"].block_ids[:3] == [1, 2, 3] and new["b"].num_computed_tokens == 12
    assert new["c"].num_computed_tokens == 0
    scheduler.update(plan, worker.execute(plan))
    run_to_completion(scheduler, worker)
    assert scheduler.stats().prefix_cache_hits == 12
    assert_no_leaked_blocks(scheduler)


def test_a_chunked_prefix_is_shared_chunk_by_chunk():
    scheduler, worker = make_scheduler(num_blocks=32, max_num_batched_tokens=8)
    prompt = list(range(30, 54))  # 24 tokens, 6 blocks of 4; a computes 8 a step
    scheduler.add_request(make_request("a", prompt, max_tokens=2))
    scheduler.add_request(make_request("b", prompt, max_tokens=2))
    run_to_completion(scheduler, worker)
    # b's full blocks but the last, and of that one all but the last token (copied: a partial hit)
    assert scheduler.stats().prefix_cache_hits == 23
    assert_no_leaked_blocks(scheduler)


def test_a_partial_hit_gives_way_when_its_source_would_take_the_last_block():
    """A prompt filling the whole pool, cached: the copy of its last block's shared tokens would
    hold that block as the source beside a fresh one, one more than the pool has. The request
    recomputes those tokens instead of waiting forever (found by the property test)."""
    scheduler, worker = make_scheduler(num_blocks=5, block_size=4, max_model_len=17, max_num_batched_tokens=1,
                                       max_num_seqs=1)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 4, 0, 0, 0, 0, 0, 0]  # 16 tokens: the 4 usable blocks
    scheduler.add_request(make_request("a", prompt, max_tokens=1))
    run_to_completion(scheduler, worker)
    scheduler.add_request(make_request("b", prompt, max_tokens=1))
    result = run_to_completion(scheduler, worker)
    assert len(result.tokens["b"]) == 1
    assert scheduler.stats().prefix_cache_hits == 12  # the 3 whole blocks; the 4th recomputed
    assert_no_leaked_blocks(scheduler)


def test_generated_tokens_become_prefix_cache_hits():
    scheduler, worker = make_scheduler(sample_fn=counting_sample)
    scheduler.add_request(make_request("a", [1, 3, 5, 7, 9, 11], max_tokens=4, ignore_eos=True))
    result = run_to_completion(scheduler, worker)
    generated = result.tokens["a"]
    assert generated == [1006, 1007, 1008, 1009]
    # Tokens 0..8 were computed (the last sampled token never is): two full blocks cached.
    follow_up = [1, 3, 5, 7, 9, 11] + generated + [42]
    scheduler.add_request(make_request("b", follow_up, max_tokens=1))
    plan = scheduler.schedule()
    assert plan.new_requests[0].num_computed_tokens == 8
    scheduler.update(plan, worker.execute(plan))
    assert_no_leaked_blocks(scheduler)


def test_reset_prefix_cache_refuses_while_requests_hold_blocks():
    scheduler, worker = make_scheduler()
    prompt = list(range(20, 29))
    scheduler.add_request(make_request("a", prompt, max_tokens=2))
    step(scheduler, worker)
    assert scheduler.reset_prefix_cache() is False
    run_to_completion(scheduler, worker)
    assert scheduler.reset_prefix_cache() is True
    scheduler.add_request(make_request("b", prompt, max_tokens=1))
    plan = scheduler.schedule()
    assert plan.new_requests[0].num_computed_tokens == 0
    scheduler.update(plan, worker.execute(plan))
    assert_no_leaked_blocks(scheduler)


def test_stats_report_queue_sizes_usage_and_token_totals():
    scheduler, worker = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("a", list(range(10)), max_tokens=3))
    scheduler.add_request(make_request("b", [1, 2], max_tokens=1))
    step(scheduler, worker)
    stats = scheduler.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert stats.num_total_blocks == 10 and stats.num_free_blocks == 7 and stats.kv_cache_usage == 0.3
    run_to_completion(scheduler, worker)
    stats = scheduler.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert stats.num_prompt_tokens == 12 and stats.num_generation_tokens == 4
    assert stats.num_preemptions == 0
    assert_no_leaked_blocks(scheduler)


def test_the_scheduler_never_imports_torch():
    code = ("import sys\n"
            "from common.config import EngineConfig\n"
            "from common.protocol import EngineRequest\n"
            "from common.sampling_params import SamplingParams\n"
            "import scheduler\n"
            "from scheduler.scheduler import Scheduler\n"
            "s = Scheduler(EngineConfig(), num_blocks=64, max_model_len=256, eos_token_ids=[0])\n"
            "s.add_request(EngineRequest(request_id='x', prompt_token_ids=[1, 2, 3],\n"
            "                            sampling_params=SamplingParams()))\n"
            "assert s.schedule() is not None and s.max_num_batched_tokens == 4096\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
