"""The router in process, with plain sockets playing clients and workers, so
each recovery rule can be driven step by step."""
from __future__ import annotations


import pytest
import zmq

from common.protocol import MessageType, TokenizeJob, TokenizerReady, TokenizerReply
from common.transport import MessageDecoder, encode
from tokenizer_pool.pool_errors import POOL_ERROR_PREFIX
from tokenizer_pool.router import Router

pytestmark = pytest.mark.timeout(60)
JOBS = MessageDecoder([MessageType.TOKENIZE, MessageType.RENDER_CHAT, MessageType.DETOKENIZE])
REPLIES = MessageDecoder([MessageType.TOKENIZER_REPLY])


@pytest.fixture
def ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def make_router(ctx):
    routers = []

    def make(**kwargs) -> Router:
        n = len(routers)
        routers.append(Router(ctx, f"inproc://front-{n}", f"inproc://back-{n}", **kwargs))
        return routers[-1]

    yield make
    for router in routers:
        router.close()


def pump(router: Router, quiet: float = 0.05) -> None:
    """Run the router's side of the conversation until it has handled everything
    sent to it so far (inproc messages are in the pipe once send returns) and
    both sockets then stay quiet for `quiet` seconds. Counting on a fixed
    window would miss messages when the test process is descheduled."""
    poller = zmq.Poller()
    poller.register(router.frontend, zmq.POLLIN)
    poller.register(router.backend, zmq.POLLIN)
    while events := dict(poller.poll(int(quiet * 1000))):
        if router.frontend in events:
            router.on_frontend_readable()
        if router.backend in events:
            router.on_backend_readable()


def connect(ctx, router: Router, side: str, identity: str | None = None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.connect((router.frontend if side == "front" else router.backend).getsockopt_string(zmq.LAST_ENDPOINT))
    return sock


def worker(ctx, router: Router, name: str) -> zmq.Socket:
    sock = connect(ctx, router, "back", name)
    sock.send_multipart(encode(TokenizerReady(worker_id=name)))
    pump(router)
    return sock


def take(sock: zmq.Socket, decoder: MessageDecoder):
    assert sock.poll(2000), "nothing arrived"
    return decoder.decode(sock.recv_multipart())


def nothing_for(sock: zmq.Socket) -> bool:
    return sock.poll(100) == 0


def test_reply_goes_back_under_the_clients_own_job_id_and_resends_are_not_rerun(ctx, make_router):
    router = make_router()
    client = connect(ctx, router, "front")
    a = worker(ctx, router, "A")
    for _ in range(2):  # the second send is a client-side resend
        client.send_multipart(encode(TokenizeJob(job_id="mine", text="hi")))
        pump(router)
    job = take(a, JOBS)
    assert job.job_id != "mine" and job.text == "hi"
    assert nothing_for(a)
    a.send_multipart(encode(TokenizerReply(job_id=job.job_id, token_ids=[7])))
    pump(router)
    assert take(client, REPLIES) == TokenizerReply(job_id="mine", token_ids=[7])


def test_silent_worker_jobs_move_to_a_live_one_and_its_late_reply_is_ignored(ctx, make_router):
    router = make_router(liveness_timeout=5.0)
    client = connect(ctx, router, "front")
    slow = worker(ctx, router, "slow")
    client.send_multipart(encode(TokenizeJob(job_id="j", text="x")))
    pump(router)
    stuck = take(slow, JOBS)
    fast = worker(ctx, router, "fast")  # heard from after slow's last word
    slow_seen = router.balancer.workers["slow"].last_seen
    router.check_liveness(now=slow_seen + 4.9)
    assert set(router.balancer.workers) == {"slow", "fast"}
    router.check_liveness(now=slow_seen + 5.001)  # slow has been silent too long, fast has not
    assert list(router.balancer.workers) == ["fast"]
    moved = take(fast, JOBS)
    assert moved.job_id == stuck.job_id
    fast.send_multipart(encode(TokenizerReply(job_id=moved.job_id, token_ids=[1])))
    slow.send_multipart(encode(TokenizerReply(job_id=stuck.job_id, token_ids=[2])))  # too late
    pump(router)
    assert take(client, REPLIES).token_ids == [1]
    assert nothing_for(client)


def test_a_job_that_outlives_max_dispatches_workers_fails_with_a_pool_error(ctx, make_router):
    router = make_router(max_dispatches=2)
    client = connect(ctx, router, "front")
    client.send_multipart(encode(TokenizeJob(job_id="poison", text="x")))
    pump(router)
    for name in ("A", "B"):
        w = worker(ctx, router, name)
        take(w, JOBS)
        router.remove_worker(name, "process exited")
    reply = take(client, REPLIES)
    assert reply.job_id == "poison" and reply.error.startswith(POOL_ERROR_PREFIX)
    assert "2 tokenizer workers were lost" in reply.error


def test_a_worker_that_cannot_be_reached_is_dropped_and_its_job_goes_elsewhere(ctx, make_router):
    router = make_router()
    client = connect(ctx, router, "front")
    liar = connect(ctx, router, "back", "someone-else")
    liar.send_multipart(encode(TokenizerReady(worker_id="ghost")))  # no connection is named "ghost"
    pump(router)
    assert "ghost" in router.balancer.workers
    client.send_multipart(encode(TokenizeJob(job_id="j", text="x")))
    pump(router)
    assert "ghost" not in router.balancer.workers
    liar.send_multipart(encode(TokenizerReply(job_id="made-up", token_ids=[1])))  # a reply makes no member
    pump(router)
    assert router.balancer.workers == {}
    real = worker(ctx, router, "real")
    assert take(real, JOBS).text == "x"


def test_workers_that_stop_or_cannot_be_reached_do_not_use_up_a_jobs_dispatches(ctx, make_router):
    """A stop (`leaving`) and a send to a peer already gone are not crashes caused by the job: a
    job may meet more of them than max_dispatches and still be answered. A crash still counts."""
    router = make_router(max_dispatches=2)
    client = connect(ctx, router, "front")
    client.send_multipart(encode(TokenizeJob(job_id="j", text="x")))
    pump(router)
    for name in ("A", "B", "C"):  # each takes the job, then says it is stopping
        w = worker(ctx, router, name)
        taken = take(w, JOBS)
        w.send_multipart(encode(TokenizerReady(worker_id=name, leaving=True)))
        pump(router)
        assert name not in router.balancer.workers
    for name in ("ghost-1", "ghost-2", "ghost-3"):  # announced by others: sends to them fail
        liar = connect(ctx, router, "back", "someone-else")
        liar.send_multipart(encode(TokenizerReady(worker_id=name)))
        pump(router)
    assert router.balancer.workers == {} and nothing_for(client)
    crashing = worker(ctx, router, "D")
    take(crashing, JOBS)
    router.remove_worker("D", "process exited")  # its first charged loss: below the limit
    assert nothing_for(client)
    last = worker(ctx, router, "E")
    job = take(last, JOBS)
    assert job.job_id == taken.job_id
    last.send_multipart(encode(TokenizerReply(job_id=job.job_id, token_ids=[5])))
    pump(router)
    assert take(client, REPLIES) == TokenizerReply(job_id="j", token_ids=[5])


def test_overload_is_refused_with_a_pool_error(ctx, make_router):
    router = make_router(max_queued=1)
    client = connect(ctx, router, "front")
    client.send_multipart(encode(TokenizeJob(job_id="1", text="x")))
    client.send_multipart(encode(TokenizeJob(job_id="2", text="x")))
    pump(router)
    reply = take(client, REPLIES)
    assert reply.job_id == "2" and reply.error.startswith(POOL_ERROR_PREFIX + "overloaded")
    assert router.balancer.num_queued() == 1
