"""Small asyncio helpers: merging request streams, cancelling work whose client left."""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import AsyncIterator, Awaitable, TypeVar

from starlette.requests import Request

T = TypeVar("T")
_DONE = object()


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


async def merge_async_iterators(iterators: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Yield (index, item) from all iterators as items arrive. The first error
    is raised; closing the merged iterator closes every source (so each
    request's own cleanup, e.g. its abort, runs)."""
    if len(iterators) == 1:  # the common case needs no tasks
        async with aclosing(iterators[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def drain(index: int, iterator: AsyncIterator[T]) -> None:
        try:
            async with aclosing(iterator):
                async for item in iterator:
                    queue.put_nowait((index, item))
            queue.put_nowait((index, _DONE))
        except Exception as e:  # handed to the consumer, which raises it
            queue.put_nowait((index, _Failure(e)))

    tasks = [asyncio.create_task(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, _Failure):
                raise item.error
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read already, so the next ASGI message is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run `work` until done or until the client disconnects (then cancel it).
    Returns (completed, result)."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is shutting down
        work_task.cancel()
        raise
    finally:
        watcher.cancel()
    if work_task.done():
        return True, work_task.result()
    work_task.cancel()  # the client is gone: stop generating for it
    await asyncio.gather(work_task, return_exceptions=True)
    return False, None
