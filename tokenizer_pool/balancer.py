"""The router's bookkeeping: which workers are alive, which jobs wait, which
job runs where. No sockets here, so every rule can be tested directly.

Jobs get a router-wide key (what workers see as `job_id`) so that two clients
may use the same job ids, and a late reply from a worker that was given up on
can be told apart from the reply of the worker that took the job over.
"""
from __future__ import annotations

import itertools
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

from common.protocol import DetokenizeJob, RenderChatJob, TokenizeJob

Job = TokenizeJob | RenderChatJob | DetokenizeJob


class QueueFull(Exception):
    """More jobs are waiting than the router is willing to hold."""


@dataclass(slots=True)
class PendingJob:
    key: str  # router-internal job id, unique across router restarts
    client: bytes  # the frontend's routing identity
    job: Job  # as the client sent it (its own job_id)
    dispatches: int = 0  # how many workers were handed this job
    worker: str | None = None  # where it runs now; None while queued


@dataclass(slots=True)
class WorkerInfo:
    worker_id: str
    last_seen: float  # monotonic time of the last message from this worker
    last_assigned: float = 0.0  # for least-recently-used tie breaking
    jobs: set[str] = field(default_factory=set)  # keys in flight


class Balancer:
    """Least-busy dispatch (ties go to the worker idle the longest), a FIFO of
    waiting jobs, and re-dispatch of the jobs of a worker that went away.

    `capacity` is how many jobs one worker may hold at once (1: a worker gets
    its next job only after answering the previous one). A job handed to
    `max_dispatches` workers that all vanished is given up (a job that kills
    every worker must not kill the whole pool in turn).
    """

    def __init__(self, *, capacity: int = 1, max_dispatches: int = 3, max_queued: int = 4096):
        if capacity < 1 or max_dispatches < 1 or max_queued < 1:
            raise ValueError("capacity, max_dispatches and max_queued must be positive")
        self.capacity = capacity
        self.max_dispatches = max_dispatches
        self.max_queued = max_queued
        self.workers: dict[str, WorkerInfo] = {}
        self.jobs: dict[str, PendingJob] = {}
        self._queue: deque[str] = deque()
        self._by_client_job: dict[tuple[bytes, str], str] = {}
        self._prefix = os.urandom(4).hex()
        self._counter = itertools.count()

    # ---- jobs -------------------------------------------------------------
    def submit(self, client: bytes, job: Job) -> PendingJob | None:
        """Queue a job; None when the same client already has this job id
        pending (a resend after a client-side timeout)."""
        client_key = (client, job.job_id)
        if client_key in self._by_client_job:
            return None
        if len(self._queue) >= self.max_queued:
            raise QueueFull(f"{len(self._queue)} jobs already waiting")
        pending = PendingJob(key=f"{self._prefix}.{next(self._counter)}", client=client, job=job)
        self.jobs[pending.key] = pending
        self._by_client_job[client_key] = pending.key
        self._queue.append(pending.key)
        return pending

    def finish(self, key: str) -> PendingJob | None:
        """The first reply for a job; None for unknown keys (late or duplicate replies)."""
        pending = self.jobs.pop(key, None)
        if pending is None:
            return None
        self._by_client_job.pop((pending.client, pending.job.job_id), None)
        if pending.worker is None:
            self._queue.remove(key)  # answered by a worker that had been given up on
        else:
            worker = self.workers.get(pending.worker)
            if worker is not None:
                worker.jobs.discard(key)
        return pending

    def num_queued(self) -> int:
        return len(self._queue)

    # ---- workers ----------------------------------------------------------
    def worker_alive(self, worker_id: str, now: float, *, register: bool = True) -> bool:
        """Record a sign of life; True when the worker is new to the pool
        (added only when `register`)."""
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.last_seen = now
            return False
        if register:
            self.workers[worker_id] = WorkerInfo(worker_id, last_seen=now)
        return register

    def remove_worker(self, worker_id: str, *, charge: bool = True) -> tuple[list[PendingJob], list[PendingJob]]:
        """Forget a worker. Returns (jobs put back at the head of the queue,
        jobs given up because they already used up their dispatches). Without
        `charge` (the worker said it is stopping) its jobs get their dispatch back:
        they did not take a worker down."""
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return [], []
        requeued, given_up = [], []
        # oldest first, so re-dispatched jobs keep their order ahead of newer ones
        for key in sorted(worker.jobs, key=lambda k: int(k.rsplit(".", 1)[1]), reverse=True):
            pending = self.jobs[key]
            pending.worker = None
            if not charge:
                pending.dispatches -= 1
            if pending.dispatches >= self.max_dispatches:
                self.jobs.pop(key)
                self._by_client_job.pop((pending.client, pending.job.job_id), None)
                given_up.append(pending)
            else:
                self._queue.appendleft(key)
                requeued.append(pending)
        requeued.reverse()
        return requeued, given_up

    def silent_workers(self, now: float, timeout: float) -> list[str]:
        return [w.worker_id for w in self.workers.values() if now - w.last_seen > timeout]

    def next_liveness_deadline(self, timeout: float) -> float | None:
        """When the quietest worker will count as dead, if nothing is heard from it."""
        if not self.workers:
            return None
        return min(w.last_seen for w in self.workers.values()) + timeout

    def undeliverable(self, pending: PendingJob) -> None:
        """The job handed to `pending.worker` never reached it: that dispatch does not count."""
        pending.dispatches -= 1

    # ---- dispatch ---------------------------------------------------------
    def assignments(self, now: float) -> Iterator[tuple[str, PendingJob]]:
        """Hand queued jobs to workers with room, least busy first. The caller
        sends each job as it is yielded."""
        while self._queue:
            worker = self._least_busy()
            if worker is None:
                return
            pending = self.jobs[self._queue.popleft()]
            pending.worker = worker.worker_id
            pending.dispatches += 1
            worker.jobs.add(pending.key)
            worker.last_assigned = now
            yield worker.worker_id, pending

    def _least_busy(self) -> WorkerInfo | None:
        best = None
        for worker in self.workers.values():
            if len(worker.jobs) >= self.capacity:
                continue
            if best is None or (len(worker.jobs), worker.last_assigned) < (len(best.jobs), best.last_assigned):
                best = worker
        return best
