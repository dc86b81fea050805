"""Requests with several samples (n > 1, best_of): one prefill, forked
samples sharing the prompt blocks, per-sample outputs and aborts; and prompt
logprobs gathered across chunks and preemptions."""
from __future__ import annotations

import pytest

from common.errors import InvalidRequestError
from common.protocol import FinishReason, PromptLogprobs, StepResult, TokenLogprobs, sample_request_id
from tests.scheduler.fake_worker import (FakeWorker, RunResult, assert_no_leaked_blocks, deterministic_sample,
                                         make_request, make_scheduler, record, run_to_completion, step)

BLOCK = 4


def test_samples_fork_after_the_prompt_and_share_its_full_blocks():
    scheduler, worker = make_scheduler(num_blocks=40, block_size=BLOCK, max_model_len=64)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks, then 1 token
    scheduler.add_request(make_request("r", prompt, max_tokens=5, n=3))
    result = RunResult()
    step(scheduler, worker, result)  # the prefill of sample 0 only
    assert [(o.index, len(o.new_token_ids)) for o in result.outputs] == [(0, 1)]
    kv = scheduler.kv_cache_manager
    parent, child1, child2 = (kv.req_to_blocks[sample_request_id("r", i)] for i in range(3))
    assert child1 == child2 == parent[:3] and all(block.ref_cnt == 3 for block in parent[:3])
    plan = scheduler.schedule()
    news = {new.request_id: new for new in plan.new_requests}
    assert set(news) == {"r#1", "r#2"}
    for new in news.values():  # each computes just the last prompt token, in a fresh block
        assert new.num_computed_tokens == 12 and plan.num_scheduled_tokens[new.request_id] == 1
        assert new.block_ids[:3] == [b.block_id for b in parent[:3]] and new.block_ids[3] != parent[3].block_id
    record(result, scheduler.update(plan, worker.execute(plan)))
    run_to_completion(scheduler, worker, result=result)
    assert worker.num_computed_tokens_total == 13 + 2 * 1 + 3 * 4  # the prompt once, then decodes
    assert {key: len(tokens) for key, tokens in result.tokens.items()} == {"r": 5, "r#1": 5, "r#2": 5}
    finished = [o for o in result.outputs if o.finish_reason is not None]
    assert sorted(o.index for o in finished) == [0, 1, 2]
    assert [o.request_finished for o in finished] == [False, False, True]
    stats = scheduler.stats()
    assert stats.prefix_cache_queries == 3 * 13 and stats.prefix_cache_hits == 2 * 12
    assert stats.num_prompt_tokens == 13
    assert_no_leaked_blocks(scheduler)


def test_a_prompt_of_whole_blocks_leaves_its_last_block_to_each_sample():
    scheduler, worker = make_scheduler(num_blocks=40, block_size=BLOCK, max_model_len=64)
    scheduler.add_request(make_request("r", list(range(10, 18)), max_tokens=3, n=2))  # exactly 2 blocks
    step(scheduler, worker)
    kv = scheduler.kv_cache_manager
    assert kv.req_to_blocks["r#1"] == kv.req_to_blocks["r#0"][:1]
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens["r#1"] == BLOCK  # it recomputes the last block into its own
    scheduler.update(plan, worker.execute(plan))
    run_to_completion(scheduler, worker)
    assert_no_leaked_blocks(scheduler)


def test_aborting_one_sample_or_the_whole_request():
    scheduler, worker = make_scheduler(num_blocks=40, block_size=BLOCK, max_model_len=64)
    scheduler.add_request(make_request("r", [5, 6, 7, 8, 9], max_tokens=30, n=3, ignore_eos=True))
    result = RunResult()
    for _ in range(3):
        step(scheduler, worker, result)
    [aborted] = scheduler.abort_requests([sample_request_id("r", 1)])
    assert (aborted.request_id, aborted.index, aborted.finish_reason, aborted.more_samples) == (
        "r", 1, FinishReason.ABORT, True)
    step(scheduler, worker, result)
    assert {o.index for o in result.outputs[-2:]} == {0, 2}
    outputs = scheduler.abort_requests(["r"])
    assert sorted(o.index for o in outputs) == [0, 2]
    assert [o.request_finished for o in outputs] == [False, True]
    assert not scheduler.has_unfinished_requests() and scheduler.abort_requests(["r"]) == []
    step(scheduler, worker)  # the worker drops the finished samples with the next plan
    assert_no_leaked_blocks(scheduler)


def test_client_ids_are_looked_up_never_parsed_as_sample_ids():
    """A client's id may look like a sample id: "job#1" is a request of its own."""
    scheduler, worker = make_scheduler(num_blocks=40, block_size=BLOCK, max_model_len=64)
    scheduler.add_request(make_request("job#1", [5, 6, 7], max_tokens=30, ignore_eos=True))
    scheduler.add_request(make_request("r", [5, 6, 7, 8, 9], max_tokens=30, n=2, ignore_eos=True))
    for _ in range(2):
        step(scheduler, worker)
    assert [scheduler.client_request_id(i) for i in ("job#1", "r#0", "r#1", "r", "gone")] == [
        "job#1", "r", "r", "r", "gone"]
    [aborted] = scheduler.abort_requests(["job#1"])
    assert (aborted.request_id, aborted.finish_reason) == ("job#1", FinishReason.ABORT)
    assert len(scheduler.abort_requests(["r"])) == 2 and not scheduler.has_unfinished_requests()
    step(scheduler, worker)
    assert_no_leaked_blocks(scheduler)


def test_aborting_before_the_fork_ends_every_sample():
    scheduler, worker = make_scheduler(num_blocks=40, block_size=BLOCK, max_model_len=64, max_num_batched_tokens=4)
    scheduler.add_request(make_request("r", list(range(10, 30)), max_tokens=5, n=4))
    step(scheduler, worker)  # the first chunk of the prompt
    [output] = scheduler.abort_requests(["r"])
    assert output.index == 0 and output.request_finished
    assert not scheduler.has_unfinished_requests()
    assert_no_leaked_blocks(scheduler)


def test_samples_beyond_max_num_seqs_wait_and_find_the_prompt_in_the_prefix_cache():
    scheduler, worker = make_scheduler(num_blocks=40, block_size=BLOCK, max_model_len=64, max_num_seqs=2,
                                       sample_fn=deterministic_sample())
    scheduler.add_request(make_request("r", list(range(10, 23)), max_tokens=4, n=3, ignore_eos=True))
    step(scheduler, worker)
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 1
    result = run_to_completion(scheduler, worker)
    assert len(result.finish_reasons) == 3
    assert scheduler.stats().prefix_cache_hits == 2 * 12  # the fork, then the cache on admission
    assert_no_leaked_blocks(scheduler)


def test_sample_ids_count_as_in_flight_ids():
    scheduler, _ = make_scheduler(num_blocks=40, block_size=BLOCK, max_model_len=64)
    scheduler.add_request(make_request("r", [5, 6], n=2))
    for request_id in ("r", "r#0", "r#1"):  # r#1 is not forked yet, but will be
        with pytest.raises(InvalidRequestError):
            scheduler.add_request(make_request(request_id, [5, 6]))
    scheduler.add_request(make_request("r#2", [5, 6]))  # no sample of "r"
    scheduler.add_request(make_request("p#1", [5, 6]))
    with pytest.raises(InvalidRequestError):
        scheduler.add_request(make_request("p", [5, 6], n=2))  # its sample p#1 would clash
    assert "p" not in scheduler._groups


class PromptScoringWorker(FakeWorker):
    """Also reports prompt logprobs: position p scores prompt token p + 1
    with logprob -(p + 1), so the gathered list is easy to check."""

    def execute(self, plan):
        wanted = {new.request_id for new in plan.new_requests if new.sampling_params.prompt_logprobs is not None}
        self.scoring = getattr(self, "scoring", set()) | wanted
        self.scoring -= set(plan.finished_request_ids) - wanted
        starts = {rid: self.requests[rid].num_computed_tokens if rid in self.requests else None
                  for rid in plan.num_scheduled_tokens}
        for new in plan.new_requests:
            starts[new.request_id] = new.num_computed_tokens
        result = super().execute(plan)
        chunks = {}
        for request_id, count in plan.num_scheduled_tokens.items():
            state = self.requests[request_id]
            start, end = starts[request_id], min(starts[request_id] + count, state.num_prompt_tokens - 1)
            if request_id in self.scoring and end > start:
                chunks[request_id] = PromptLogprobs(first_token_index=start + 1, positions=[
                    TokenLogprobs(state.token_ids[p + 1], -(p + 1.0), 1) for p in range(start, end)])
        return StepResult(step_id=result.step_id, request_ids=result.request_ids,
                          sampled_token_ids=result.sampled_token_ids, prompt_logprobs=chunks)


def test_prompt_logprobs_are_gathered_over_chunks_and_sent_once_without_prefix_hits():
    scheduler, _ = make_scheduler(num_blocks=40, block_size=BLOCK, max_model_len=64, max_num_batched_tokens=5)
    worker = PromptScoringWorker(40, BLOCK)
    prompt = list(range(10, 27))
    run_to_completion(scheduler, worker)
    scheduler.add_request(make_request("warm", prompt, max_tokens=2))  # fills the prefix cache
    run_to_completion(scheduler, worker)
    scheduler.add_request(make_request("r", prompt, max_tokens=3, prompt_logprobs=2, n=2))
    result = run_to_completion(scheduler, worker)
    first = next(o for o in result.outputs if o.request_id == "r")
    assert [e.token_id for e in first.prompt_logprobs] == prompt[1:]
    assert [e.logprob for e in first.prompt_logprobs] == [-(p + 1.0) for p in range(len(prompt) - 1)]
    assert sum(o.prompt_logprobs is not None for o in result.outputs) == 1
    assert first.num_cached_tokens == 0  # every prompt position had to be computed


def test_prompt_logprobs_survive_a_preemption_mid_prompt():
    scheduler, _ = make_scheduler(num_blocks=9, block_size=BLOCK, max_model_len=32, max_num_batched_tokens=6)
    worker = PromptScoringWorker(9, BLOCK)
    scheduler.add_request(make_request("hog", list(range(40, 50)), max_tokens=20, ignore_eos=True))
    scheduler.add_request(make_request("r", list(range(10, 29)), max_tokens=2, prompt_logprobs=1, ignore_eos=True))
    result = run_to_completion(scheduler, worker)
    assert scheduler.stats().num_preemptions > 0
    first = next(o for o in result.outputs if o.request_id == "r")
    assert [e.token_id for e in first.prompt_logprobs] == list(range(11, 29))
    assert_no_leaked_blocks(scheduler)
