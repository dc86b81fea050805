"""gRPC's DEADLINE_EXCEEDED and INTERNAL, provoked for real through the
generated stub on the slow stack (50 ms steps, --request-timeout 5): a
client deadline and the server's request timeout both end a long Generate
with DEADLINE_EXCEEDED and abort it (its KV blocks come back, the stack
serves on); a prompt that kills two workers ends with INTERNAL."""
from __future__ import annotations

import grpc
import pytest

from common.grpc_gen import pagedserve_pb2 as pb
from common.grpc_gen import pagedserve_pb2_grpc as pb_grpc
from polling import wait_for
from tests.reliability.conftest import POISON, REQUEST_TIMEOUT_S

STEP_S = 0.05  # the slow stack's fake worker step
LONG_TOKENS = int(2 * REQUEST_TIMEOUT_S / STEP_S)  # outlives the request timeout twice over


def generate(stack, text: str, max_tokens: int, **call_kwargs) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(stack.grpc_address) as channel:
        request = pb.GenerateRequest(text=text, sampling_params=pb.SamplingParams(max_tokens=max_tokens))
        return list(pb_grpc.PagedServeStub(channel).Generate(request, **call_kwargs))


def assert_aborted_and_serving_on(stack, before: int) -> None:
    """The request's blocks came back short of its LONG_TOKENS (aborted, not run
    to its end), and the next request is answered in full."""
    generated = stack.wait_all_blocks_free(timeout=60).num_generation_tokens - before
    assert 0 < generated < LONG_TOKENS, generated
    chunks = generate(stack, "one", 4, timeout=60)
    assert "".join(c.text for c in chunks) == stack.expected_text(4)
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_a_client_deadline_gives_deadline_exceeded_and_aborts_the_request(slow_stack):
    before = slow_stack.wait_all_blocks_free().num_generation_tokens
    with grpc.insecure_channel(slow_stack.grpc_address) as channel:
        call = pb_grpc.PagedServeStub(channel).Generate(pb.GenerateRequest(
            text="one two", sampling_params=pb.SamplingParams(max_tokens=LONG_TOKENS)), timeout=3)
        # The deadline must strike mid-generation: a first chunk proves the request runs.
        assert next(call).token_ids
        with pytest.raises(grpc.RpcError) as error:
            list(call)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_aborted_and_serving_on(slow_stack, before)


def test_the_servers_request_timeout_gives_deadline_exceeded(slow_stack):
    before = slow_stack.wait_all_blocks_free().num_generation_tokens
    with pytest.raises(grpc.RpcError) as error:
        generate(slow_stack, "one two", LONG_TOKENS, timeout=120)  # the client would wait much longer
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error.value.details()
    assert f"request timeout of {REQUEST_TIMEOUT_S}s" in error.value.details()
    assert_aborted_and_serving_on(slow_stack, before)


def test_a_request_that_kills_two_workers_gives_internal(slow_stack):
    """A real fault, no mock: the fake worker process exits on the poison token,
    the standby that takes over dies the same way, and the scheduler fails the
    request (status 500) instead of handing it to a third worker."""
    slow_stack.wait_all_blocks_free()
    standing_by = slow_stack.scheduler.log().count("stands by")
    alive = [w for w in slow_stack.workers if w.proc.poll() is None]
    for _ in range(3 - len(alive)):  # one registered, two standing by
        slow_stack.workers.append(slow_stack.start_worker())
    wait_for(lambda: slow_stack.scheduler.log().count("stands by") >= standing_by + 3 - len(alive),
             "two standby workers")
    with pytest.raises(grpc.RpcError) as error:
        generate(slow_stack, f"one {POISON} two", 5, timeout=120)
    assert error.value.code() == grpc.StatusCode.INTERNAL, error.value.details()
    assert "died 2 times while running this request" in error.value.details()
    wait_for(lambda: len([w for w in slow_stack.workers if w.proc.poll() is None]) == 1, "two workers to die")
    chunks = generate(slow_stack, "one", 4, timeout=60)  # the third serves on
    assert "".join(c.text for c in chunks) == slow_stack.expected_text(4)
    slow_stack.wait_all_blocks_free()
