"""Workers dying, hanging and joining; the pool stopping without orphans."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tokenizer_pool.tokenizer_client import TokenizerClient
from polling import async_wait_for
from tokenizer_pool_helpers import CORPUS, alive, child_pids, wait_until

pytestmark = pytest.mark.timeout(180)


def big_texts(n: int, size: int) -> list[str]:
    """Texts long enough that a job takes a few milliseconds, so jobs are in flight when we strike."""
    base = " ".join(CORPUS)
    return [f"{i} " + (base * (size // len(base) + 1))[:size] for i in range(n)]


def test_killed_worker_jobs_complete_then_sigterm_leaves_no_children(start_pool, tiny_tokenizer_dir, tiny_tokenizer):
    # A long liveness timeout: the victim is stopped while it holds its job, and
    # must leave the pool because its process exits, not because it went silent.
    pool = start_pool(["--model", tiny_tokenizer_dir, "--tokenizer-pool-size", "2", "--liveness-timeout", "600"])
    assert pool.wait_for_log(r"joined the pool \(2 workers\)", timeout=60), pool.log()
    victim, survivor = pool.workers()
    texts = big_texts(40, 20_000)

    async def run_jobs_and_kill():
        async with TokenizerClient(pool.frontend, timeout=120) as client:
            # The stopped victim is handed one job (the router gives each idle worker
            # one before either gets a second) and never answers it; the survivor
            # does all the others. So when all but one are done, the victim holds
            # the last one: the kill is certain to catch a job in flight.
            os.kill(victim, signal.SIGSTOP)
            try:
                jobs = [asyncio.ensure_future(client.encode(t)) for t in texts]
                await async_wait_for(lambda: sum(j.done() for j in jobs) == len(jobs) - 1,
                                     "every job but the stopped victim's to finish")
            finally:
                os.kill(victim, signal.SIGKILL)
            return await asyncio.gather(*jobs)

    results = asyncio.run(run_jobs_and_kill())
    assert results == [tiny_tokenizer.encode(t) for t in texts]
    assert pool.wait_for_log(r"tokenizer worker \d \(pid %d\) exited with code -9; restarting it in" % victim)
    assert pool.wait_for_log(r"left the pool \(process exited\); re-dispatching 1 job"), pool.log()
    assert pool.wait_for_log(r"restarting tokenizer worker \d \(restart #1\)")
    assert pool.wait_for_log(r"joined the pool", count=3, timeout=60), pool.log()
    restarted = [pid for pid in pool.workers() if pid != survivor]
    assert len(restarted) == 1 and restarted[0] != victim
    assert asyncio.run(_encode_once(pool.frontend, "after the restart")) == tiny_tokenizer.encode("after the restart")

    children = child_pids(pool.pid)  # both workers and multiprocessing's resource tracker
    pool.proc.send_signal(signal.SIGTERM)
    assert pool.proc.wait(20) == 0
    assert wait_until(lambda: not any(alive(pid) for pid in children), timeout=10), children
    assert "stopped 2 tokenizer worker(s)" in pool.log()


def test_sigkilled_pool_takes_its_workers_along(start_pool, tiny_tokenizer_dir):
    pool = start_pool(["--model", tiny_tokenizer_dir, "--tokenizer-pool-size", "2"])
    assert pool.wait_for_log(r"joined the pool \(2 workers\)", timeout=60), pool.log()
    workers = pool.workers()
    assert len(workers) == 2, (workers, pool.log())
    os.kill(pool.pid, signal.SIGKILL)  # no chance to clean up: the kernel's parent-death signal must do it
    pool.proc.wait(10)
    assert wait_until(lambda: not any(alive(pid) for pid in workers), timeout=10), workers


def test_remote_workers_join_survive_a_router_restart_and_a_hung_one_is_replaced(start_pool, tiny_tokenizer_dir, tiny_tokenizer):
    router = start_pool(["--tokenizer-pool-size", "0", "--liveness-timeout", "1.5", "--heartbeat-interval", "0.3"],
                        name="router")
    join = ["--join", router.backend, "--model", tiny_tokenizer_dir, "--tokenizer-pool-size", "1",
            "--heartbeat-interval", "0.3"]

    async def scenario():
        async with TokenizerClient(router.frontend, timeout=60) as client:
            # no workers yet: the job waits in the router until one joins
            waiting = asyncio.ensure_future(client.encode("queued before any worker"))
            await asyncio.sleep(0.5)
            assert not waiting.done()
            first = start_pool(join, name="join-a")
            assert await waiting == tiny_tokenizer.encode("queued before any worker")
            assert "pagedserve: tokenizer" in open(f"/proc/{first.pid}/cmdline").read().replace("\0", " ")

            start_pool(join, name="join-b")
            assert await asyncio.to_thread(router.wait_for_log, r"joined the pool \(2 workers\)", 1, 60)
            hung = first.workers()[0]
            os.kill(hung, signal.SIGSTOP)  # alive but silent: only the heartbeat timeout can tell
            try:
                texts = big_texts(20, 20_000)
                results = await asyncio.gather(*(client.encode(t) for t in texts))
                assert results == [tiny_tokenizer.encode(t) for t in texts]
            finally:
                os.kill(hung, signal.SIGCONT)

    asyncio.run(scenario())
    log = router.log()
    assert "left the pool (silent for more than 1.5s); re-dispatching 1 job(s)" in log, log
    # the resumed worker heartbeats again and is taken back
    assert router.wait_for_log(r"joined the pool", count=3, timeout=20), router.log()

    # a new router on the same addresses: the remote workers reconnect and announce themselves again
    router.proc.kill()
    router.proc.wait()
    new_router = start_pool(["--tokenizer-pool-size", "0", "--liveness-timeout", "1.5"], name="router-2",
                            frontend=router.frontend, backend=router.backend)
    assert new_router.wait_for_log(r"joined the pool \(2 workers\)", timeout=20), new_router.log()
    assert asyncio.run(_encode_once(new_router.frontend, "new router")) == tiny_tokenizer.encode("new router")


async def _encode_once(address: str, text: str) -> list[int]:
    async with TokenizerClient(address, timeout=30) as client:
        return await client.encode(text)
