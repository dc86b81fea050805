"""Stop conditions, aborts and request validation."""
import logging

import pytest

from common.errors import InvalidRequestError
from common.protocol import FinishReason
from tests.scheduler.fake_worker import (assert_no_leaked_blocks, make_request, make_scheduler, run_to_completion,
                                         step)

EOS = 2


def scripted(*tokens):
    """Sample these tokens in order (per request), then keep repeating the last."""
    num_sampled: dict[str, int] = {}

    def sample(request_id, token_ids):
        index = num_sampled.get(request_id, 0)
        num_sampled[request_id] = index + 1
        return tokens[min(index, len(tokens) - 1)]
    return sample


def run_one(prompt=(5, 6, 7), tokens=(9,), max_model_len=40, eos_token_ids=(EOS,), **params):
    scheduler, worker = make_scheduler(max_model_len=max_model_len, eos_token_ids=eos_token_ids,
                                       sample_fn=scripted(*tokens))
    scheduler.add_request(make_request("r", list(prompt), **params))
    result = run_to_completion(scheduler, worker)
    assert_no_leaked_blocks(scheduler)
    return result.tokens["r"], result.finish_reasons["r"]


def test_eos_stops_and_is_included_in_the_output():
    assert run_one(tokens=(9, 10, EOS, 11)) == ([9, 10, EOS], FinishReason.STOP)


def test_any_of_several_eos_ids_stops():
    assert run_one(tokens=(9, 77), eos_token_ids=(EOS, 77)) == ([9, 77], FinishReason.STOP)


def test_ignore_eos_runs_to_max_tokens():
    assert run_one(tokens=(EOS,), max_tokens=4, ignore_eos=True) == ([EOS] * 4, FinishReason.LENGTH)


def test_min_tokens_defers_eos_and_stop_token_ids():
    assert run_one(tokens=(EOS,), min_tokens=3, max_tokens=10) == ([EOS] * 3, FinishReason.STOP)
    assert run_one(tokens=(33, 33, 33, 33), min_tokens=2, stop_token_ids=[33]) == ([33, 33], FinishReason.STOP)


def test_stop_token_ids_stop_even_with_ignore_eos():
    assert run_one(tokens=(9, 33), stop_token_ids=[33, 34], ignore_eos=True) == ([9, 33], FinishReason.STOP)


def test_max_tokens_gives_length():
    assert run_one(tokens=(9,), max_tokens=5) == ([9] * 5, FinishReason.LENGTH)


def test_eos_on_the_last_allowed_token_is_a_stop():
    assert run_one(tokens=(9, EOS), max_tokens=2) == ([9, EOS], FinishReason.STOP)


def test_max_tokens_none_fills_the_context():
    tokens, reason = run_one(prompt=range(10), tokens=(9,), max_tokens=None, max_model_len=16)
    assert (len(tokens), reason) == (6, FinishReason.LENGTH)


def test_max_model_len_caps_a_larger_max_tokens():
    tokens, reason = run_one(prompt=range(10), tokens=(9,), max_tokens=100, max_model_len=13)
    assert (len(tokens), reason) == (3, FinishReason.LENGTH)


def test_prompt_must_leave_room_for_one_output_token():
    scheduler, worker = make_scheduler(max_model_len=16)
    with pytest.raises(InvalidRequestError) as err:
        scheduler.add_request(make_request("long", list(range(16))))
    assert "16 tokens" in err.value.message and "(max_model_len) is 16" in err.value.message
    with pytest.raises(InvalidRequestError) as err:
        scheduler.add_request(make_request("longer", list(range(20))))
    assert "20" in err.value.message and "16" in err.value.message
    with pytest.raises(InvalidRequestError, match="empty"):
        scheduler.add_request(make_request("empty", []))
    with pytest.raises(InvalidRequestError) as err:
        scheduler.add_request(make_request("bad", [1], temperature=-1.0))
    assert err.value.param == "temperature"
    assert not scheduler.has_unfinished_requests()

    scheduler.add_request(make_request("fits", list(range(15)), max_tokens=None))
    result = run_to_completion(scheduler, worker)
    assert len(result.tokens["fits"]) == 1 and result.finish_reasons["fits"] is FinishReason.LENGTH
    assert_no_leaked_blocks(scheduler)


def test_token_ids_outside_the_vocabulary_are_rejected_on_admission():
    # A bad id would fail the worker's whole step (every request in it), so the
    # scheduler refuses it when it knows the worker's vocabulary.
    from common.config import EngineConfig
    from scheduler.scheduler import Scheduler
    scheduler = Scheduler(EngineConfig(block_size=4, device="cpu"), num_blocks=11, max_model_len=40,
                          eos_token_ids=[EOS], vocab_size=100)
    for bad in (100, -1):
        with pytest.raises(InvalidRequestError, match=f"Token id {bad} is out of vocabulary") as err:
            scheduler.add_request(make_request("r", [5, bad, 7]))
        assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as err:
        scheduler.add_request(make_request("r", [5], stop_token_ids=[100]))
    assert err.value.param == "stop_token_ids"
    assert not scheduler.has_unfinished_requests()
    scheduler.add_request(make_request("r", [0, 99]))


def test_max_model_len_beyond_the_cache_is_capped_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="scheduler.scheduler"):
        scheduler, worker = make_scheduler(num_blocks=5, max_model_len=20)  # 4 usable blocks: 16 tokens
    # The 17th token is sampled but never needs KV, so 17 tokens fit.
    assert scheduler.max_model_len == 17
    assert "max_model_len=20" in caplog.text
    with pytest.raises(InvalidRequestError, match="17"):
        scheduler.add_request(make_request("r", list(range(17))))
    scheduler.add_request(make_request("r", list(range(14)), max_tokens=None))
    result = run_to_completion(scheduler, worker)
    assert len(result.tokens["r"]) == 3
    assert_no_leaked_blocks(scheduler)


def test_duplicate_request_id_is_rejected_while_in_flight_and_reusable_after():
    scheduler, worker = make_scheduler()
    scheduler.add_request(make_request("same", [1, 2, 3], max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already in flight"):
        scheduler.add_request(make_request("same", [4, 5]))
    step(scheduler, worker)
    step(scheduler, worker)  # finishes
    scheduler.add_request(make_request("same", [4, 5], max_tokens=1))
    plan = scheduler.schedule()
    # The new incarnation's full data replaces the old state; its id must not be dropped afterwards.
    assert [n.request_id for n in plan.new_requests] == ["same"] and plan.finished_request_ids == []
    assert plan.new_requests[0].token_ids == [4, 5]
    scheduler.update(plan, worker.execute(plan))
    assert_no_leaked_blocks(scheduler)


def test_abort_is_idempotent_and_frees_blocks():
    scheduler, worker = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("running", list(range(9)), max_tokens=10))
    scheduler.add_request(make_request("waiting", [1, 2], max_tokens=10))
    step(scheduler, worker)
    assert scheduler.kv_cache_manager.get_block_ids("running") == [1, 2, 3]

    outputs = scheduler.abort_requests(["running", "nope", "running", "waiting"])
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs] == [
        ("running", [], FinishReason.ABORT), ("waiting", [], FinishReason.ABORT)]
    assert outputs[0].num_prompt_tokens == 9
    assert scheduler.abort_requests(["running", "waiting"]) == []
    assert scheduler.abort_requests("running") == []  # a lone id is not iterated letter by letter
    assert not scheduler.has_unfinished_requests()
    assert_no_leaked_blocks(scheduler)

    scheduler.add_request(make_request("next", [3, 4], max_tokens=1))
    plan = scheduler.schedule()
    assert plan.finished_request_ids == ["running"]  # only the one the worker knows
    scheduler.update(plan, worker.execute(plan))
    assert_no_leaked_blocks(scheduler)


def test_abort_while_a_step_is_in_flight_drops_its_token():
    scheduler, worker = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=5))
    scheduler.add_request(make_request("b", [4, 5, 6], max_tokens=5))
    plan = scheduler.schedule()
    [aborted] = scheduler.abort_requests(["a"])
    assert aborted.finish_reason is FinishReason.ABORT
    outputs = scheduler.update(plan, worker.execute(plan))
    assert [o.request_id for o in outputs] == ["b"]
    plan = scheduler.schedule()
    assert plan.finished_request_ids == ["a"] and list(plan.num_scheduled_tokens) == ["b"]
    scheduler.update(plan, worker.execute(plan))
    run_to_completion(scheduler, worker)
    assert_no_leaked_blocks(scheduler)


def test_step_result_must_match_the_plan():
    scheduler, worker = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3]))
    plan = scheduler.schedule()
    result = worker.execute(plan)
    result.step_id += 1
    with pytest.raises(ValueError, match="step"):
        scheduler.update(plan, result)
    scheduler.abort_requests(["a"])
    assert_no_leaked_blocks(scheduler)


@pytest.mark.parametrize("max_logprobs, allowed, refused", [(20, 20, 21), (50, 50, 51), (-1, 10_000, None)])
def test_max_logprobs_bounds_what_a_request_may_ask(max_logprobs, allowed, refused):
    scheduler, _ = make_scheduler(max_logprobs=max_logprobs)
    scheduler.add_request(make_request("ok", [5, 6], logprobs=allowed, prompt_logprobs=allowed))
    if refused is not None:
        for field in ("logprobs", "prompt_logprobs"):
            with pytest.raises(InvalidRequestError) as error:
                scheduler.add_request(make_request(f"too-many-{field}", [5, 6], **{field: refused}))
            assert error.value.param == field
