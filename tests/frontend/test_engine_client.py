"""EngineClient against a fake scheduler on a real ZMQ socket: routing of
outputs, hello/heartbeat, abort on early close, resubmitting in-flight
requests to a scheduler that comes back (or dropped them), and 503 when none
comes back in time or a connected one stalls."""
import asyncio
from contextlib import aclosing, asynccontextmanager

import pytest
import zmq

from common.protocol import EngineOutputs, FinishReason, RequestOutput
from common.sampling_params import SamplingParams
from frontend.engine.engine_client import EngineClient
from frontend.api_errors import ServiceUnavailableError
from local_ports import free_port
from polling import async_wait_for
from tests.frontend.fakes import FakeScheduler

EOS = 99
SCRIPT = [5, 6, 7, 8]
SLOW = 1


def make_scheduler(address: str) -> FakeScheduler:
    return FakeScheduler(address, SCRIPT, EOS, slow_token=SLOW, slow_script=[3], slow_interval=0.05).start()


@pytest.fixture
def address():
    return f"tcp://127.0.0.1:{free_port()}"


@asynccontextmanager
async def started(client: EngineClient):
    await client.start()
    try:
        yield client
    finally:
        await client.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def collect(client: EngineClient, request_id: str, prompt: list[int], **params):
    outputs = []
    async with aclosing(client.generate(request_id, prompt, SamplingParams(**params))) as stream:
        async for output in stream:
            outputs.append(output)
    return outputs


@pytest.mark.parametrize("transport", ["tcp", "ipc"])  # `pagedserve serve` uses ipc:// sockets
def test_generate_routes_outputs_and_says_hello(address, transport, tmp_path):
    if transport == "ipc":
        address = f"ipc://{tmp_path}/scheduler"
    scheduler = make_scheduler(address)

    async def main():
        async with started(EngineClient(address, heartbeat_interval=0.1)) as client:
            a, b = await asyncio.gather(collect(client, "a", [10, 11], max_tokens=3),
                                        collect(client, "b", [12], max_tokens=None))
            await async_wait_for(lambda: len(scheduler.snapshot().hellos) >= 3, "a hello and two heartbeats")
            return client.frontend_id, a, b

    try:
        frontend_id, a, b = run(main())
    finally:
        scheduler.stop()
    assert [o.new_token_ids for o in a] == [[5], [6], [7]]
    assert [o.finish_reason for o in a] == [None, None, FinishReason.LENGTH]
    assert [t for o in b for t in o.new_token_ids] == SCRIPT + [EOS]
    assert b[-1].finish_reason == FinishReason.STOP
    received = scheduler.snapshot()
    assert {r.request_id: r.prompt_token_ids for r in received.requests} == {"a": [10, 11], "b": [12]}
    assert len(received.hellos) >= 3  # on connect, then every heartbeat interval
    assert all(peer == frontend_id.encode() and h.frontend_id == frontend_id for peer, h in received.hellos)
    assert received.aborts == []  # finished requests are not aborted


def test_closing_a_stream_early_aborts_the_request(address):
    scheduler = make_scheduler(address)

    async def main():
        async with started(EngineClient(address)) as client:
            stream = client.generate("slow", [SLOW], SamplingParams(max_tokens=None, ignore_eos=True))
            async with aclosing(stream):
                async for _ in stream:
                    break  # the client went away after the first token
            assert not client.is_in_flight("slow")

    try:
        run(main())
        assert scheduler.wait_for(lambda r: r.aborts == ["slow"])
    finally:
        scheduler.stop()


def test_duplicate_request_id_is_rejected(address):
    scheduler = make_scheduler(address)

    async def main():
        async with started(EngineClient(address)) as client:
            first = client.generate("same", [SLOW], SamplingParams(max_tokens=None, ignore_eos=True))
            async with aclosing(first):
                await first.__anext__()
                with pytest.raises(Exception, match="already in flight"):
                    await collect(client, "same", [10])

    try:
        run(main())
    finally:
        scheduler.stop()


def test_no_scheduler_fails_fast_with_503(address):
    async def main():
        async with started(EngineClient(address, connect_grace=0.3)) as client:
            with pytest.raises(ServiceUnavailableError):  # run() fails the test if it waits instead
                await collect(client, "x", [10])

    run(main())


COUNTING = list(range(10, 40))  # a script whose every token differs: a repeat or a gap shows


def counting_scheduler(address: str) -> FakeScheduler:
    return FakeScheduler(address, COUNTING, EOS, interval=0.05).start()


def test_a_request_survives_its_scheduler_dying_and_resumes_where_it_was(address):
    scheduler = counting_scheduler(address)
    resubmit_counts = []

    async def main():
        nonlocal scheduler
        async with started(EngineClient(address, on_resubmit=resubmit_counts.append)) as client:
            tokens = []
            stream = client.generate("survivor", [1, 2], SamplingParams(max_tokens=12))
            async with aclosing(stream):
                async for output in stream:
                    tokens += output.new_token_ids
                    if len(tokens) == 4:
                        scheduler.stop()  # the scheduler process dies mid-request
                        await async_wait_for(lambda: not client.connected, "the loss to be seen")
                        await asyncio.sleep(0.3)  # the request waits meanwhile
                        scheduler = counting_scheduler(address)  # restarted: the client reconnects by itself
                    last = output
            return tokens, last

    try:
        tokens, last = run(main())
        restarted = scheduler.snapshot()
    finally:
        scheduler.stop()
    assert tokens == COUNTING[:12]  # no token repeated or missing
    assert last.finish_reason == FinishReason.LENGTH and last.attempt == 1
    (resubmitted,) = restarted.requests
    assert resubmitted.attempt == 1 and resubmitted.prompt_token_ids == [1, 2]
    assert [(r.index, r.output_token_ids, r.finished) for r in resubmitted.resumed] == [(0, COUNTING[:4], False)]
    assert "survivor" in restarted.aborts  # before the resubmission, in case the scheduler still held it
    assert resubmit_counts == [1]  # (counted for the metrics)
    assert restarted.hellos, "no FrontendHello after reconnecting"


def test_samples_resume_each_from_its_own_tokens_and_a_stopped_one_stays_stopped(address):
    scheduler = counting_scheduler(address)

    async def main():
        nonlocal scheduler
        async with started(EngineClient(address)) as client:
            tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
            restarted = False
            stream = client.generate("three", [1], SamplingParams(n=3, max_tokens=8))
            async with aclosing(stream):
                async for output in stream:
                    tokens[output.index] += output.new_token_ids
                    if output.index == 2 and len(tokens[2]) == 2:
                        client.abort(["three#2"])  # as a matched stop string does
                    if sum(map(len, tokens.values())) >= 9 and not restarted:
                        restarted = True
                        scheduler.stop()
                        await async_wait_for(lambda: not client.connected, "the loss to be seen")
                        scheduler = counting_scheduler(address)
            return tokens

    try:
        tokens = run(main())
        (resubmitted,) = scheduler.snapshot().requests
    finally:
        scheduler.stop()
    assert tokens[0] == tokens[1] == COUNTING[:8]
    assert tokens[2] == COUNTING[:2]
    resumed = {r.index: r for r in resubmitted.resumed}
    assert resumed[2].finished and resumed[2].output_token_ids == COUNTING[:2]
    assert not resumed[0].finished and resumed[0].output_token_ids == COUNTING[:len(resumed[0].output_token_ids)]


def test_in_flight_requests_fail_with_503_when_no_scheduler_comes_back_in_time(address):
    scheduler = make_scheduler(address)

    async def main():
        async with started(EngineClient(address, restart_timeout=0.5)) as client:
            stream = client.generate("doomed", [SLOW], SamplingParams(max_tokens=None, ignore_eos=True))
            async with aclosing(stream):
                await stream.__anext__()
                scheduler.stop()
                with pytest.raises(ServiceUnavailableError, match="did not come back within 0s|within 1s"):
                    async for _ in stream:
                        pass
            assert not client.connected

    run(main())


def test_a_request_that_keeps_losing_its_scheduler_fails_with_503(address, monkeypatch):
    import frontend.engine.engine_client as engine_client
    monkeypatch.setattr(engine_client, "MAX_RESUBMISSIONS", 1)
    scheduler = counting_scheduler(address)

    async def main():
        nonlocal scheduler
        async with started(EngineClient(address)) as client:
            stream = client.generate("unlucky", [1], SamplingParams(max_tokens=30))
            async with aclosing(stream):
                with pytest.raises(ServiceUnavailableError, match="lost 2 times while running this request"):
                    async for output in stream:
                        if output.attempt == 0 or output.new_token_ids == [COUNTING[8]]:
                            scheduler.stop()  # first after its first token, then after 8 more
                            await async_wait_for(lambda: not client.connected, "the loss to be seen")
                            scheduler = counting_scheduler(address)

    try:
        run(main())
    finally:
        scheduler.stop()


def test_a_new_request_waits_for_a_scheduler_that_comes_back(address):
    async def main():
        async with started(EngineClient(address, connect_grace=20)) as client:
            waiting = asyncio.ensure_future(collect(client, "patient", [10], max_tokens=2))
            await asyncio.sleep(0.5)
            assert not waiting.done()
            scheduler = make_scheduler(address)  # e.g. the supervisor restarting it
            try:
                outputs = await waiting
            finally:
                scheduler.stop()
            return outputs

    outputs = run(main())
    assert [t for o in outputs for t in o.new_token_ids] == [5, 6]


def test_outputs_of_a_replaced_attempt_are_dropped(address):
    scheduler = counting_scheduler(address)

    async def main():
        async with started(EngineClient(address)) as client:
            tokens = []
            stream = client.generate("r", [1], SamplingParams(max_tokens=6))
            async with aclosing(stream):
                async for output in stream:
                    tokens += output.new_token_ids
                    if len(tokens) == 2:
                        # The scheduler says it dropped the request (it thought this frontend
                        # gone): resubmitted, and late outputs of attempt 0 are ignored.
                        client._dispatch(EngineOutputs(outputs=[], dropped={"r": 0}))
                        client._dispatch(EngineOutputs(outputs=[RequestOutput(request_id="r", new_token_ids=[77])]))
            return tokens

    try:
        tokens = run(main())
        requests = scheduler.snapshot().requests
    finally:
        scheduler.stop()
    assert 77 not in tokens
    assert tokens == COUNTING[:6]
    assert [r.attempt for r in requests] == [0, 1]
    assert requests[1].resumed[0].output_token_ids == COUNTING[:2]


class SilentRouter:
    """Accepts connections and never answers (a hung scheduler)."""

    def __init__(self, address: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(address)

    def close(self):
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.mark.parametrize("healthy", [False, True])
def test_stall_fails_requests_only_when_the_health_probe_fails(address, healthy):
    router = SilentRouter(address)
    probes = []

    async def probe() -> bool:
        probes.append(healthy)
        return healthy

    async def main():
        async with started(EngineClient(address, health_probe=probe, stall_timeout=0.4)) as client:
            if healthy:
                # Still waiting after the watchdog asked twice: a busy scheduler is not dead.
                request = asyncio.ensure_future(collect(client, "stalled", [10]))
                await async_wait_for(lambda: len(probes) >= 2 or request.done(), "two health probes")
                assert not request.done()
                request.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await request
            else:
                with pytest.raises(ServiceUnavailableError, match="stopped responding"):
                    await collect(client, "stalled", [10])

    try:
        run(main())
    finally:
        router.close()
    assert probes
