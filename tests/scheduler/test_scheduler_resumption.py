"""Requests a frontend resubmits to a new scheduler (`EngineRequest.resumed`):
each sample carries on from its tokens so far and ends exactly as it would
have without the interruption; finished samples stay finished; outputs echo
the attempt; bad resumptions are refused; no block leaks."""
from __future__ import annotations

import msgspec
import pytest

from common.errors import InvalidRequestError
from common.protocol import EngineRequest, FinishReason, ResumedSample
from tests.scheduler.fake_worker import (RunResult, assert_no_leaked_blocks, make_request, make_scheduler,
                                         run_to_completion, step)

VOCAB = 1000


def per_sample(request_id: str, token_ids: list[int]) -> int:
    """A 'model' whose next token depends on the sample's id and its tokens so far (like a seeded
    sampler), never EOS (2) unless the sequence is long."""
    value = sum(ord(c) for c in request_id) * 7 + 17
    for token in token_ids:
        value = (value * 31 + token) % 1_000_003
    return 3 + value % (VOCAB - 3)


def scheduler_and_worker():
    return make_scheduler(num_blocks=60, block_size=4, max_model_len=64, sample_fn=per_sample)


def samples_of(result: RunResult, request_id: str, n: int) -> dict[int, list[int]]:
    return {i: result.tokens.get(request_id if i == 0 else f"{request_id}#{i}", []) for i in range(n)}


@pytest.mark.parametrize("n", [1, 3])
def test_a_resumed_request_ends_as_an_uninterrupted_one(n):
    request = make_request("r", list(range(10, 23)), max_tokens=9, n=n, min_tokens=4)
    scheduler, worker = scheduler_and_worker()
    scheduler.add_request(request)
    expected = samples_of(run_to_completion(scheduler, worker), "r", n)

    # The first scheduler gets a few steps in, then is lost with everything it held.
    scheduler, worker = scheduler_and_worker()
    scheduler.add_request(request)
    before = RunResult()
    for _ in range(4):
        step(scheduler, worker, before)
    so_far = samples_of(before, "r", n)
    assert all(0 < len(tokens) < 9 for tokens in so_far.values()), so_far
    resumed = [ResumedSample(index=i, output_token_ids=tokens) for i, tokens in so_far.items()]

    scheduler, worker = scheduler_and_worker()
    scheduler.add_request(msgspec.structs.replace(request, attempt=1, resumed=resumed))
    after = run_to_completion(scheduler, worker)
    assert {i: so_far[i] + tokens for i, tokens in samples_of(after, "r", n).items()} == expected
    assert all(output.attempt == 1 for output in after.outputs)
    finished = [o for o in after.outputs if o.finish_reason is not None]
    assert [o.request_finished for o in finished] == [False] * (n - 1) + [True]
    assert set(after.finish_reasons.values()) == {FinishReason.LENGTH}
    assert_no_leaked_blocks(scheduler)


def test_finished_samples_are_not_run_again_and_the_request_ends_with_the_last_live_one():
    scheduler, worker = scheduler_and_worker()
    request = make_request("r", [5, 6, 7], max_tokens=6, n=3)
    resumed = [ResumedSample(index=0, output_token_ids=[40, 41], finished=True),  # a stop string ended it
               ResumedSample(index=2, output_token_ids=[50])]
    scheduler.add_request(msgspec.structs.replace(request, attempt=2, resumed=resumed))
    result = run_to_completion(scheduler, worker)
    assert "r" not in result.tokens  # sample 0 never ran again
    assert len(result.tokens["r#1"]) == 6 and len(result.tokens["r#2"]) == 5  # 1 + 5 new
    assert [o.request_finished for o in result.outputs if o.finish_reason is not None] == [False, True]
    assert_no_leaked_blocks(scheduler)


@pytest.mark.parametrize("resumed, message", [
    ([ResumedSample(index=1, output_token_ids=[4])], "out of range"),
    ([ResumedSample(index=0, output_token_ids=[4]), ResumedSample(index=0, output_token_ids=[4])], "repeated"),
    ([ResumedSample(index=0, output_token_ids=[4] * 6)], "at most 5"),
    ([ResumedSample(index=0, output_token_ids=[VOCAB])], "out of vocabulary"),
    ([ResumedSample(index=0, output_token_ids=[4], finished=True)], "finished already"),
])
def test_bad_resumptions_are_refused(resumed, message):
    from scheduler.scheduler import Scheduler
    from common.config import EngineConfig
    scheduler = Scheduler(EngineConfig(block_size=4, device="cpu"), num_blocks=20, max_model_len=64,
                          eos_token_ids=[2], vocab_size=VOCAB)
    request = EngineRequest(request_id="r", prompt_token_ids=[5, 6],
                            sampling_params=make_request("r", [5], max_tokens=6).sampling_params,
                            attempt=1, resumed=resumed)
    with pytest.raises(InvalidRequestError, match=message):
        scheduler.add_request(request)
    assert not scheduler.has_unfinished_requests()
