"""The tokenizer worker's job log: the first job at once, then a count at most once a minute."""
from __future__ import annotations

import logging

from tokenizer_pool import tokenize_worker


def test_first_job_then_a_count_per_interval(monkeypatch, caplog):
    now = [100.0]
    monkeypatch.setattr(tokenize_worker.time, "monotonic", lambda: now[0])
    counter = tokenize_worker.JobCounter("w1", interval=60.0)
    caplog.set_level(logging.INFO, logger=tokenize_worker.__name__)
    counter.add()
    for _ in range(9):
        now[0] += 1.0
        counter.add()
    assert [r.getMessage() for r in caplog.records] == ["tokenizer worker w1 served its first job"]
    now[0] += 60.0
    counter.add()
    now[0] += 1.0
    counter.add()
    messages = [r.getMessage() for r in caplog.records]
    assert messages[1:] == ["tokenizer worker w1 served 11 jobs (10 in the last 69 s)"]
