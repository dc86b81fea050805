"""Data parallelism in the frontend: the prefix-affinity map, the ReplicaRouter's
choices (prefix affinity, load balance, skipping a replica that is down or
full, retrying one that fails before its first output), and the router over
two fake schedulers on real ZMQ sockets."""
from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from common.grpc_gen import control_pb2
from common.protocol import FinishReason, RequestOutput
from common.sampling_params import SamplingParams
from frontend.api_errors import OverloadedError, ServiceUnavailableError
from frontend.engine.prefix_affinity import PrefixAffinity, block_hashes
from frontend.engine.replica_controls import ReplicaControls, summed_stats
from frontend.engine.replica_router import ReplicaRouter
from local_ports import free_port
from polling import async_wait_for

BLOCK = 4


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


# --- the prefix map ---------------------------------------------------------------
def test_block_hashes_chain_full_blocks_and_the_salt():
    a = block_hashes(list(range(10)), BLOCK)
    assert len(a) == 2  # the last two tokens are no full block
    assert block_hashes(list(range(8)) + [77, 78], BLOCK) == a
    assert block_hashes([0, 1, 2, 3, 9, 5, 6, 7], BLOCK)[0] == a[0]
    assert block_hashes([0, 1, 2, 3, 9, 5, 6, 7], BLOCK)[1] != a[1]  # a block's hash depends on all before it
    assert block_hashes(list(range(10)), BLOCK, "salt") != a


def test_match_depths_per_replica_and_the_lru_bound():
    affinity = PrefixAffinity(3, capacity=6)
    long, other = block_hashes(list(range(16)), BLOCK), block_hashes(list(range(100, 108)), BLOCK)
    affinity.record(long[:2], 0)
    affinity.record(long, 1)
    assert affinity.match_depths(long) == [2, 4, 0]
    assert affinity.match_depths(other) == [0, 0, 0]
    affinity.record(other, 2)  # 6 blocks now
    affinity.record(block_hashes(list(range(200, 204)), BLOCK), 2)  # the least recently used block goes
    assert len(affinity) == 6 and affinity.match_depths(long) == [0, 0, 0]
    affinity.forget_replica(2)
    assert affinity.match_depths(other) == [0, 0, 0] and len(affinity) == 3


# --- the router over stand-in engines ------------------------------------------------
class StubEngine:
    """What the router asks of an EngineClient; each request waits for `release`."""

    def __init__(self, name: str):
        self.scheduler_address = name
        self.frontend_id = "frontend-test"
        self.connected, self.queue_full = True, False
        self.failures: list[Exception] = []  # the next requests fail with these (may be shared)
        self.requests: list[str] = []
        self.aborted: list[str] = []
        self.release = asyncio.Event()

    @property
    def num_in_flight(self) -> int:
        return 0

    async def ensure_connected(self) -> None:
        if not self.connected:
            raise ServiceUnavailableError("down")
        if self.queue_full:
            raise OverloadedError()

    async def generate(self, request_id, prompt_token_ids, sampling_params, **kwargs):
        await self.ensure_connected()
        self.requests.append(request_id)
        if self.failures:
            raise self.failures.pop()
        await self.release.wait()
        yield RequestOutput(request_id=request_id, new_token_ids=[1], finish_reason=FinishReason.LENGTH)

    def abort(self, request_ids):
        self.aborted.extend(request_ids)

    def end_all(self, error):
        pass


class StubControl:
    address = "control"

    async def model_info(self):
        return control_pb2.ModelInfo(block_size=BLOCK)


def make_router(count: int = 2, **kwargs) -> tuple[ReplicaRouter, list[StubEngine], list[tuple[int, str]]]:
    engines = [StubEngine(f"replica-{i}") for i in range(count)]
    routed: list[tuple[int, str]] = []
    router = ReplicaRouter([(e, StubControl()) for e in engines], on_route=lambda i, why: routed.append((i, why)),
                           **kwargs)
    return router, engines, routed


async def consume(router: ReplicaRouter, request_id: str, prompt: list[int], n: int = 1) -> list[RequestOutput]:
    async with aclosing(router.generate(request_id, prompt, SamplingParams(max_tokens=1, n=n))) as stream:
        return [output async for output in stream]


async def submit(router, engines, request_id: str, prompt: list[int]) -> asyncio.Task:
    """Start a request and wait until some replica holds it."""
    task = asyncio.create_task(consume(router, request_id, prompt))
    await async_wait_for(lambda: any(request_id in e.requests for e in engines) or task.done(), request_id)
    return task


def holder(engines: list[StubEngine], request_id: str) -> int:
    return next(i for i, e in enumerate(engines) if request_id in e.requests)


SYSTEM = list(range(1000, 1032))  # a shared 32-token prefix: 8 blocks


def test_shared_prefix_prompts_go_to_the_replica_that_holds_the_prefix():
    async def main():
        router, engines, routed = make_router()
        tasks = [await submit(router, engines, "first", SYSTEM + [1])]
        tasks.append(await submit(router, engines, "other", [7, 8, 9, 10, 11]))  # the less loaded replica
        for i in range(3):
            tasks.append(await submit(router, engines, f"shared{i}", SYSTEM + [2 + i, 3]))
        for engine in engines:
            engine.release.set()
        await asyncio.gather(*tasks)
        return engines, routed

    engines, routed = run(main())
    first = holder(engines, "first")
    assert holder(engines, "other") == 1 - first
    assert [holder(engines, f"shared{i}") for i in range(3)] == [first] * 3
    assert routed == [(first, "load"), (1 - first, "load")] + [(first, "prefix")] * 3


def test_distinct_prompts_spread_evenly_and_a_busy_prefix_holder_is_passed_over():
    async def main():
        router, engines, routed = make_router(balance_abs=2, balance_rel=1.5)
        tasks = [await submit(router, engines, f"d{i}", [i] * 9) for i in range(6)]
        spread = [len(e.requests) for e in engines]
        # Every request shares the prefix: the holder takes them until it has 3 more than the other.
        tasks += [await submit(router, engines, f"s{i}", SYSTEM + [i]) for i in range(6)]
        for engine in engines:
            engine.release.set()
        await asyncio.gather(*tasks)
        return spread, engines, routed

    spread, engines, routed = run(main())
    assert spread == [3, 3]
    shared = [holder(engines, f"s{i}") for i in range(6)]
    # Loads 3/3: the first goes by load; its replica keeps the prefix's requests while it has
    # at most 2 more (4/3, 5/3); at 6/3 (more than 2 more and more than 1.5 times) balance wins,
    # and from then on both hold the prefix: the less loaded of them.
    assert shared == [shared[0]] * 3 + [1 - shared[0]] * 3
    assert [why for _, why in routed[6:]] == ["load", "prefix", "prefix", "load", "prefix", "prefix"]


def test_a_replica_that_is_down_or_full_is_skipped_and_a_failed_start_is_retried():
    async def main():
        router, engines, _ = make_router()
        engines[0].connected = False
        for engine in engines:
            engine.release.set()
        await asyncio.gather(*(consume(router, f"a{i}", [i] * 9) for i in range(4)))
        placed_while_down = [list(e.requests) for e in engines]
        engines[0].connected, engines[1].queue_full = True, True
        await consume(router, "b", [5] * 9)
        engines[1].queue_full = False
        # The chosen replica fails before any output: the request goes to the other one.
        engines[0].failures = engines[1].failures = [ServiceUnavailableError("lost the connection")]
        outputs = await consume(router, "c", [6] * 9)
        both_failed = None
        engines[0].failures = engines[1].failures = [ServiceUnavailableError("lost the connection")] * 2
        try:
            await consume(router, "d", [7] * 9)
        except ServiceUnavailableError as e:
            both_failed = e
        return placed_while_down, engines, outputs, both_failed

    placed_while_down, engines, outputs, both_failed = run(main())
    assert placed_while_down == [[], ["a0", "a1", "a2", "a3"]]
    assert "b" in engines[0].requests and "b" not in engines[1].requests
    assert engines[0].requests.count("c") + engines[1].requests.count("c") == 2 and outputs[0].request_id == "c"
    assert both_failed is not None  # every replica failed: the error reaches the client


def test_ensure_connected_needs_one_replica_that_takes_requests():
    async def main():
        router, engines, _ = make_router()
        await router.ensure_connected()
        engines[0].connected = False
        await router.ensure_connected()
        engines[1].queue_full = True
        with pytest.raises(OverloadedError):
            await router.ensure_connected()
        engines[1].connected = False
        with pytest.raises(ServiceUnavailableError):
            await router.ensure_connected()

    run(main())


def test_aborts_reach_the_replica_running_the_request_or_its_sample():
    async def main():
        router, engines, _ = make_router()
        task = asyncio.create_task(consume(router, "r", [1] * 9, n=2))
        await async_wait_for(lambda: any("r" in e.requests for e in engines), "the request to start")
        router.abort(["r#1"])
        router.abort(["unknown"])
        for engine in engines:
            engine.release.set()
        await task
        return engines

    engines = run(main())
    owner = holder(engines, "r")
    assert engines[owner].aborted == ["r#1", "unknown"] and engines[1 - owner].aborted == ["unknown"]


# --- the controls, and the router over real sockets ------------------------------------
def test_replica_stats_are_summed_with_kv_usage_over_all_blocks():
    a = control_pb2.SchedulerStats(num_running=2, kv_cache_usage=0.5, num_blocks=100, prefix_cache_hits=3,
                                   num_generation_tokens=10)
    b = control_pb2.SchedulerStats(num_running=1, kv_cache_usage=0.0, num_blocks=300, prefix_cache_hits=4,
                                   num_generation_tokens=5)
    total = summed_stats([a, None, b])
    assert (total.num_running, total.num_blocks, total.prefix_cache_hits, total.num_generation_tokens) == (
        3, 400, 7, 15)
    assert total.kv_cache_usage == pytest.approx(0.125)
    assert summed_stats([None, None]) is None


def test_router_over_two_fake_schedulers_survives_one_going_down():
    from frontend.engine.control_client import ControlClient
    from frontend.engine.engine_client import EngineClient
    from tests.frontend.fakes import FakeControl, FakeScheduler

    schedulers = [FakeScheduler(f"tcp://127.0.0.1:{free_port()}", [5, 6, 7], 99).start() for _ in range(2)]
    controls = [FakeControl(1000, 200).start(f"127.0.0.1:{free_port()}") for _ in range(2)]

    async def main():
        pairs = [(EngineClient(s.address, connect_grace=0.2), ControlClient(c.address))
                 for s, c in zip(schedulers, controls)]
        router = ReplicaRouter(pairs)
        health = ReplicaControls(router.replicas)
        await router.start()
        try:
            await async_wait_for(lambda: all(e.connected for e, _ in pairs), "both schedulers connected")
            assert (await health.health()).message == "2 of 2 replicas ready"
            first = await asyncio.gather(*(consume(router, f"a{i}", [i + 1] * 20) for i in range(8)))
            schedulers[0].stop()
            await async_wait_for(lambda: not pairs[0][0].connected, "the first scheduler's loss to be seen")
            second = await asyncio.gather(*(consume(router, f"b{i}", [i + 1] * 20) for i in range(8)))
            reply = await health.health()
            return first, second, reply, await health.stats()
        finally:
            await router.close()
            await health.close()

    try:
        first, second, reply, stats = run(main())
    finally:
        for s in schedulers[1:]:
            s.stop()
        for c in controls:
            c.stop()
    assert all(outputs[-1].finish_reason == FinishReason.LENGTH for outputs in first + second)
    got = [{r.request_id for r in s.snapshot().requests} for s in schedulers]
    firsts = {f"a{i}" for i in range(8)}
    assert got[0] & firsts and got[1] & firsts and (got[0] | got[1]) >= firsts  # both served (how evenly: timing)
    assert {f"b{i}" for i in range(8)} <= got[1]  # the replica that is down gets none
    assert reply.ok and reply.message == "1 of 2 replicas ready"
    assert stats.num_running == 2 * 3  # FakeControl's numbers, from both control services
