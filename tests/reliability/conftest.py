"""Fixtures: model-free stacks (real frontend, tokenizer pool and scheduler
processes around a fake worker), started once per session."""
from __future__ import annotations

import pytest

from tests.reliability.stack import Stack

API_KEY = "sk-test-3f9b2c"
POISON = "~"  # a prompt holding it kills the slow stack's workers
HANG = "^"  # a prompt holding it hangs them for 5 s (their step timeout is 1 s)
REQUEST_TIMEOUT_S = 5


@pytest.fixture(scope="session")
def fast_stack(tmp_path_factory):
    """Requires API_KEY; small body limit; a worker as fast as it gets."""
    stack = Stack(tmp_path_factory.mktemp("fast-stack"), step_delay=0.0,
                  frontend_args=["--api-key", API_KEY, "--max-request-body-size", "64KiB"],
                  scheduler_args=["--max-num-seqs", "16"])
    try:
        stack.wait_healthy()
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="session")
def slow_stack(tmp_path_factory):
    """One request runs at a time, two may wait; 50 ms per step; requests time
    out after 5 s; workers die on a prompt holding POISON, hang on HANG."""
    stack = Stack(tmp_path_factory.mktemp("slow-stack"), step_delay=0.05, poison_text=POISON, hang_text=HANG,
                  frontend_args=["--request-timeout", str(REQUEST_TIMEOUT_S)],
                  scheduler_args=["--max-num-seqs", "1", "--max-waiting-requests", "2",
                                  "--worker-step-timeout", "1"])
    try:
        stack.wait_healthy()
        yield stack
    finally:
        stack.stop()
