"""The scheduler's side of a worker replacement, in process: running requests
go back to waiting with their tokens, the prefix cache is emptied, and a
fresh worker recomputes them to exactly the outputs of a run without the
fault; the registry decides who may take over."""
from __future__ import annotations

import random

import pytest

from common.config import EngineConfig
from common.protocol import EngineRequest, WorkerHello
from common.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.worker_registry import Verdict, WorkerRegistry
from tests.scheduler.fake_worker import FakeWorker

NUM_BLOCKS, BLOCK_SIZE = 48, 4


def next_token(request_id: str, token_ids: list[int]) -> int:
    """Deterministic in the sequence so far, like greedy decoding."""
    return (sum(token_ids) * 31 + len(token_ids)) % 997 + 3


def requests(seed: int = 0) -> list[EngineRequest]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 1000) for _ in range(9)]  # a common prefix: prefix-cache hits
    return [EngineRequest(request_id=f"r{i}", prompt_token_ids=shared + [rng.randrange(3, 1000) for _ in range(
        rng.randrange(1, 12))], sampling_params=SamplingParams(temperature=0, max_tokens=rng.randrange(5, 20),
                                                               ignore_eos=True)) for i in range(10)]


def run(fault_at_step: int | None) -> tuple[dict[str, list[int]], Scheduler]:
    config = EngineConfig(max_num_batched_tokens=24, max_num_seqs=6, block_size=BLOCK_SIZE, device="cpu")
    scheduler = Scheduler(config, num_blocks=NUM_BLOCKS, max_model_len=64, eos_token_ids=[0])
    worker = FakeWorker(NUM_BLOCKS, BLOCK_SIZE, sample_fn=next_token)
    for request in requests():
        scheduler.add_request(request)
    outputs: dict[str, list[int]] = {}
    finished: set[str] = set()
    step = 0
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        assert plan is not None
        result = worker.execute(plan)
        step += 1
        if step == fault_at_step:
            # The worker dies with this step's result: nothing of it is applied.
            moved = scheduler.requeue_running()
            scheduler.reset_prefix_cache_for_new_worker()
            assert moved > 0 and not scheduler.running
            stats = scheduler.stats()
            assert stats.num_free_blocks == NUM_BLOCKS - 1 and stats.num_waiting == 10 - len(finished)
            worker = FakeWorker(NUM_BLOCKS, BLOCK_SIZE, sample_fn=next_token)  # an empty KV cache
            continue
        for output in scheduler.update(plan, result):
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finish_reason is not None:
                finished.add(output.request_id)
    return outputs, scheduler


@pytest.mark.parametrize("fault_at_step", [1, 2, 5, 9])
def test_recomputed_requests_produce_the_same_tokens(fault_at_step):
    expected, _ = run(None)
    got, scheduler = run(fault_at_step)
    assert got == expected
    stats = scheduler.stats()
    assert stats.num_free_blocks == NUM_BLOCKS - 1 and stats.num_preemptions == 0


def test_prefix_cache_reset_refuses_while_blocks_are_held():
    config = EngineConfig(max_num_batched_tokens=32, block_size=BLOCK_SIZE, device="cpu")
    scheduler = Scheduler(config, num_blocks=NUM_BLOCKS, max_model_len=64, eos_token_ids=[0])
    scheduler.add_request(requests()[0])
    assert scheduler.schedule() is not None
    with pytest.raises(RuntimeError):
        scheduler.reset_prefix_cache_for_new_worker()
    assert scheduler.requeue_running() == 1
    scheduler.reset_prefix_cache_for_new_worker()


def hello(**changes) -> WorkerHello:
    fields = dict(rank=0, model_name="m", num_blocks=100, block_size=16, max_model_len=256, vocab_size=500,
                  eos_token_ids=[2], dtype="float32")
    return WorkerHello(**{**fields, **changes})


def test_the_registry_decides_who_takes_over():
    registry = WorkerRegistry("sched")
    assert registry.judge(b"a", hello(), has_requests=False).verdict is Verdict.FIRST
    registry.register(b"a", hello())
    assert registry.session_id == "sched.1"
    assert registry.judge(b"a", hello(), has_requests=True).verdict is Verdict.SAME
    assert registry.judge(b"b", hello(), has_requests=True).verdict is Verdict.STANDBY
    assert registry.lose() == b"a" and registry.identity is None
    assert registry.judge(b"b", hello(), has_requests=True).verdict is Verdict.REPLACEMENT
    # Another shape cannot take over waiting requests, but may start afresh when idle.
    refused = registry.judge(b"c", hello(num_blocks=50), has_requests=True)
    assert refused.verdict is Verdict.REFUSED and "num_blocks" in refused.message
    assert registry.judge(b"c", hello(num_blocks=50), has_requests=False).verdict is Verdict.FIRST
    assert registry.judge(b"c", hello(protocol_version=0), has_requests=False).verdict is Verdict.REFUSED
    registry.register(b"b", hello())
    assert registry.session_id == "sched.2"  # a new session: the worker drops stale state
