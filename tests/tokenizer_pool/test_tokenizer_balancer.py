"""The router's dispatch rules, without sockets."""
from __future__ import annotations

import pytest

from common.protocol import TokenizeJob
from tokenizer_pool.balancer import Balancer, QueueFull


def job(job_id: str) -> TokenizeJob:
    return TokenizeJob(job_id=job_id, text=job_id)


def test_jobs_wait_until_a_worker_joins_then_go_to_the_least_recently_used():
    b = Balancer()
    assert [p.job.job_id for p in (b.submit(b"c", job("a")), b.submit(b"c", job("b")))] == ["a", "b"]
    assert list(b.assignments(now=0.0)) == []  # no workers yet: both stay queued
    b.worker_alive("w1", 0.0)
    b.worker_alive("w2", 0.0)
    first = list(b.assignments(now=1.0))
    assert [(w, p.job.job_id) for w, p in first] == [("w1", "a"), ("w2", "b")]
    b.submit(b"c", job("c"))
    assert list(b.assignments(now=2.0)) == []  # capacity 1: both busy
    b.finish(first[1][1].key)  # w2 answers first and takes "c"
    (worker, c), = b.assignments(now=3.0)
    assert (worker, c.job.job_id) == ("w2", "c")
    b.finish(first[0][1].key)
    b.finish(c.key)
    b.submit(b"c", job("d"))
    # both idle; w1 was last given a job at t=1, w2 at t=3 -> w1
    assert [(w, p.job.job_id) for w, p in b.assignments(now=4.0)] == [("w1", "d")]


def test_least_busy_with_capacity_two():
    b = Balancer(capacity=2)
    for w in ("w1", "w2"):
        b.worker_alive(w, 0.0)
    for i in range(5):
        b.submit(b"c", job(str(i)))
    assigned = [w for w, _ in b.assignments(now=1.0)]
    assert sorted(assigned) == ["w1", "w1", "w2", "w2"] and b.num_queued() == 1
    assert assigned[:2] == ["w1", "w2"]  # spread before stacking


def test_resend_of_a_pending_job_is_ignored_but_other_clients_may_reuse_the_id():
    b = Balancer()
    first = b.submit(b"c1", job("x"))
    assert b.submit(b"c1", job("x")) is None
    other = b.submit(b"c2", job("x"))
    assert other is not None and other.key != first.key
    b.worker_alive("w", 0.0)
    (_, p), = b.assignments(0.0)
    assert b.finish(p.key) is p
    assert b.finish(p.key) is None  # a duplicate reply
    assert b.submit(b"c1", job("x")) is not None  # finished ids may be sent again


def test_lost_worker_jobs_are_redispatched_first_and_given_up_after_max_dispatches():
    b = Balancer(max_dispatches=2)
    b.worker_alive("w1", 0.0)
    lost = b.submit(b"c", job("lost"))
    later = b.submit(b"c", job("later"))
    assert [p.job.job_id for _, p in b.assignments(0.0)] == ["lost"]
    requeued, given_up = b.remove_worker("w1")
    assert requeued == [lost] and given_up == [] and lost.worker is None
    b.worker_alive("w2", 1.0)
    assert [p.job.job_id for _, p in b.assignments(1.0)] == ["lost"]  # ahead of "later"
    requeued, given_up = b.remove_worker("w2")
    assert requeued == [] and given_up == [lost] and lost.key not in b.jobs
    b.worker_alive("w3", 2.0)
    assert [p.job.job_id for _, p in b.assignments(2.0)] == ["later"]
    assert b.remove_worker("unknown") == ([], [])


def test_late_reply_from_a_given_up_worker_completes_the_queued_job():
    b = Balancer()
    b.worker_alive("slow", 0.0)
    p = b.submit(b"c", job("j"))
    list(b.assignments(0.0))
    b.remove_worker("slow")
    assert b.num_queued() == 1
    assert b.finish(p.key) is p  # the "dead" worker answered after all
    assert b.num_queued() == 0 and b.jobs == {}


def test_silent_workers_and_liveness_deadline():
    b = Balancer()
    assert b.next_liveness_deadline(5.0) is None
    b.worker_alive("w1", 0.0)
    b.worker_alive("w2", 3.0)
    assert b.next_liveness_deadline(5.0) == 5.0
    assert b.silent_workers(now=6.0, timeout=5.0) == ["w1"]
    assert b.worker_alive("w1", 6.0) is False  # a heartbeat from a known worker
    assert b.silent_workers(now=6.0, timeout=5.0) == []
    assert b.worker_alive("stranger", 7.0, register=False) is False and "stranger" not in b.workers


def test_queue_limit():
    b = Balancer(max_queued=2)
    b.submit(b"c", job("1"))
    b.submit(b"c", job("2"))
    with pytest.raises(QueueFull):
        b.submit(b"c", job("3"))
