"""EngineClient against a fake scheduler on a real ZMQ socket: routing of
outputs, hello/heartbeat, abort on early close, and failing fast (503) when
the scheduler dies or stalls, then reconnecting."""
import asyncio
from contextlib import aclosing

import pytest
import zmq

from common.protocol import FinishReason
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
        client = EngineClient(address, heartbeat_interval=0.1)
        await client.start()
        try:
            a, b = await asyncio.gather(collect(client, "a", [10, 11], max_tokens=3),
                                        collect(client, "b", [12], max_tokens=None))
            await async_wait_for(lambda: len(scheduler.snapshot().hellos) >= 3, "a hello and two heartbeats")
            return client.frontend_id, a, b
        finally:
            await client.close()

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
        client = EngineClient(address)
        await client.start()
        try:
            stream = client.generate("slow", [SLOW], SamplingParams(max_tokens=None, ignore_eos=True))
            async with aclosing(stream):
                async for _ in stream:
                    break  # the client went away after the first token
            assert not client.is_in_flight("slow")
        finally:
            await client.close()

    try:
        run(main())
        assert scheduler.wait_for(lambda r: r.aborts == ["slow"])
    finally:
        scheduler.stop()


def test_duplicate_request_id_is_rejected(address):
    scheduler = make_scheduler(address)

    async def main():
        client = EngineClient(address)
        await client.start()
        try:
            first = client.generate("same", [SLOW], SamplingParams(max_tokens=None, ignore_eos=True))
            async with aclosing(first):
                await first.__anext__()
                with pytest.raises(Exception, match="already in flight"):
                    await collect(client, "same", [10])
        finally:
            await client.close()

    try:
        run(main())
    finally:
        scheduler.stop()


def test_no_scheduler_fails_fast_with_503(address):
    async def main():
        client = EngineClient(address, connect_grace=0.3)
        await client.start()
        try:
            with pytest.raises(ServiceUnavailableError):  # run() fails the test if it waits instead
                await collect(client, "x", [10])
        finally:
            await client.close()

    run(main())


def test_scheduler_death_fails_in_flight_requests_then_reconnects(address):
    scheduler = make_scheduler(address)

    async def main():
        nonlocal scheduler
        client = EngineClient(address)
        await client.start()
        try:
            stream = client.generate("doomed", [SLOW], SamplingParams(max_tokens=None, ignore_eos=True))
            async with aclosing(stream):
                await stream.__anext__()
                scheduler.stop()  # the scheduler process dies mid-request
                with pytest.raises(ServiceUnavailableError):
                    async for _ in stream:
                        pass
            assert not client.connected
            scheduler = make_scheduler(address)  # restarted: the client reconnects by itself
            await async_wait_for(lambda: client.connected, "the client to reconnect")
            outputs = await collect(client, "after", [10], max_tokens=2)
            assert [t for o in outputs for t in o.new_token_ids] == [5, 6]
        finally:
            await client.close()

    try:
        run(main())
        restarted = scheduler.snapshot()
        assert restarted.hellos, "no FrontendHello after reconnecting"
        # The failed request is aborted on the new connection, in case the scheduler kept it.
        assert "doomed" in restarted.aborts
    finally:
        scheduler.stop()


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
        client = EngineClient(address, health_probe=probe, stall_timeout=0.4)
        await client.start()
        try:
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
        finally:
            await client.close()

    try:
        run(main())
    finally:
        router.close()
    assert probes
