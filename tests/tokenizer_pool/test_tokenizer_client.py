"""TokenizerClient against a stand-in router on a real socket: a router that dies
with a job and comes back gets the job again as soon as the client reconnects,
not after the resend interval."""
from __future__ import annotations

import asyncio
import threading
import time

import zmq

from common.protocol import MessageType, TokenizerReply
from common.transport import MessageDecoder, encode
from local_ports import free_port
from tokenizer_pool.tokenizer_client import TokenizerClient

JOBS = MessageDecoder([MessageType.TOKENIZE, MessageType.RENDER_CHAT, MessageType.DETOKENIZE])


def router_that_loses_its_first_job(address: str, took_job: threading.Event) -> None:
    """Take one job and die without answering; come back and answer every job."""
    ctx = zmq.Context()
    try:
        first = ctx.socket(zmq.ROUTER)
        first.bind(address)
        first.recv_multipart()
        took_job.set()
        first.close(linger=0)
        second = ctx.socket(zmq.ROUTER)
        for _ in range(200):  # the first socket's listener closes asynchronously
            try:
                second.bind(address)
                break
            except zmq.ZMQError:
                time.sleep(0.02)
        peer, *frames = second.recv_multipart()
        job = JOBS.decode(frames)
        second.send_multipart([peer, *encode(TokenizerReply(job_id=job.job_id, token_ids=[7, 8]))])
        second.close(linger=500)
    finally:
        ctx.term()


def test_a_restarted_router_gets_the_waiting_job_on_reconnection():
    address = f"tcp://127.0.0.1:{free_port()}"
    took_job = threading.Event()
    router = threading.Thread(target=router_that_loses_its_first_job, args=(address, took_job), daemon=True)
    router.start()

    async def main() -> list[int]:
        # A resend interval far longer than the test may take: only the reconnection can resend.
        async with TokenizerClient(address, resend_interval=3600, timeout=3600) as client:
            return await asyncio.wait_for(client.encode("hello"), 30)

    assert asyncio.run(main()) == [7, 8]
    assert took_job.is_set()
    router.join(5)
