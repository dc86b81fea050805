"""Starts K tokenizer worker processes, restarts any that exits (with
exponential backoff), and stops them all on shutdown.

Children are started with multiprocessing's "spawn" context (a fresh
interpreter: no inherited sockets or threads). Each exposes a `sentinel` file
descriptor that becomes readable when it exits, which the pool's poll loop
watches, so a death is noticed at once without polling in a loop.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

from tokenizer_pool.image_decoding import ImageLimits
from tokenizer_pool.tokenize_worker import DEFAULT_HEARTBEAT_INTERVAL, worker_main

logger = logging.getLogger(__name__)

MIN_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0
STABLE_AFTER_S = 30.0  # a worker up this long has its backoff reset
STOP_GRACE_S = 5.0


@dataclass
class WorkerSlot:
    index: int  # 1-based; shown in the process title
    generation: int = 0
    process: BaseProcess | None = None
    worker_id: str = ""
    started_at: float = 0.0
    backoff_s: float = MIN_BACKOFF_S
    restart_at: float | None = None


class WorkerSupervisor:
    def __init__(self, count: int, model_dir: str, backend_addr: str, *,
                 heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL, log_level: str | None = None,
                 chat_template: str | None = None, image_limits: ImageLimits = ImageLimits()):
        self._mp = multiprocessing.get_context("spawn")
        self._chat_template = chat_template
        self._image_limits = image_limits
        self._model_dir = model_dir
        self._backend_addr = backend_addr
        self._heartbeat_interval = heartbeat_interval
        self._log_level = log_level
        # unique across hosts and restarts: remote workers share one router
        self._id_prefix = f"{socket.gethostname()}-{os.getpid()}"
        self.slots = [WorkerSlot(index=i + 1) for i in range(count)]

    def start_all(self) -> None:
        for slot in self.slots:
            self._start(slot)

    def _start(self, slot: WorkerSlot) -> None:
        slot.generation += 1
        slot.worker_id = f"{self._id_prefix}-w{slot.index}.{slot.generation}"
        slot.process = self._mp.Process(
            target=worker_main, name=f"tokenizer-{slot.index}",
            args=(self._model_dir, self._backend_addr, slot.worker_id, slot.index, os.getpid(),
                  self._heartbeat_interval, self._log_level, self._chat_template, self._image_limits))
        slot.process.start()
        slot.started_at = time.monotonic()
        slot.restart_at = None
        logger.info("started tokenizer worker %d (pid %d, id %s)", slot.index, slot.process.pid, slot.worker_id)

    def sentinels(self) -> dict[int, WorkerSlot]:
        return {s.process.sentinel: s for s in self.slots if s.process is not None}

    def pids(self) -> list[int]:
        return [s.process.pid for s in self.slots if s.process is not None and s.process.is_alive()]

    def reap(self) -> list[str]:
        """Collect exited workers and schedule their restart; returns their worker ids."""
        now = time.monotonic()
        dead = []
        for slot in self.slots:
            if slot.process is None or slot.process.is_alive():
                continue
            slot.process.join()
            if now - slot.started_at > STABLE_AFTER_S:
                slot.backoff_s = MIN_BACKOFF_S
            logger.warning("tokenizer worker %d (pid %d) exited with code %s; restarting it in %.1fs",
                           slot.index, slot.process.pid, slot.process.exitcode, slot.backoff_s)
            slot.process.close()
            slot.process = None
            slot.restart_at = now + slot.backoff_s
            slot.backoff_s = min(MAX_BACKOFF_S, slot.backoff_s * 2)
            dead.append(slot.worker_id)
        return dead

    def restart_due(self) -> None:
        now = time.monotonic()
        for slot in self.slots:
            if slot.restart_at is not None and now >= slot.restart_at:
                logger.warning("restarting tokenizer worker %d (restart #%d)", slot.index, slot.generation)
                self._start(slot)

    def seconds_until_restart(self) -> float | None:
        times = [s.restart_at for s in self.slots if s.restart_at is not None]
        return None if not times else max(0.0, min(times) - time.monotonic())

    def stop(self) -> None:
        """SIGTERM every worker, then SIGKILL whatever is left after the grace period."""
        running = [s.process for s in self.slots if s.process is not None]
        for process in running:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for process in running:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                logger.warning("tokenizer worker pid %d ignored SIGTERM; killing it", process.pid)
                process.kill()
                process.join()
        for slot in self.slots:
            slot.process = None
            slot.restart_at = None
        logger.info("stopped %d tokenizer worker(s)", len(running))
