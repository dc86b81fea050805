"""Waiting in tests for something to happen: poll a condition until it holds.

Tests assert outcomes, never durations. The deadline here only keeps a broken
run from hanging, so it is generous (a loaded two-core CI machine can be many
times slower than a workstation); a test that passes never waits for it.
"""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 60.0


def wait_for(condition: Callable[[], T], what: str, *, timeout: float = DEFAULT_TIMEOUT_S,
             interval: float = 0.05) -> T:
    """Call `condition` until it returns something truthy and return that;
    AssertionError naming `what` if it never does within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout:g}s waiting for {what}")
        time.sleep(interval)


async def async_wait_for(condition: Callable[[], T | Awaitable[T]], what: str, *,
                         timeout: float = DEFAULT_TIMEOUT_S, interval: float = 0.02) -> T:
    """`wait_for` inside an event loop: sleeps with asyncio, so the loop's other
    tasks (the code under test) run while we wait. `condition` may be a coroutine function."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout:g}s waiting for {what}")
        await asyncio.sleep(interval)
