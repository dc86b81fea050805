"""The waiting queue: preempted requests first, then new ones by priority."""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from scheduler.request import Request


class WaitingQueue:
    """Requests not running, in the order they will be admitted.

    Preempted requests go to the front (the most recently pushed first), so
    work that already ran resumes before anything new starts. New requests
    follow, ordered by (priority, arrival order): a lower priority value runs
    first, equal priorities run first come, first served. Removal from the
    heap (aborts) is lazy: the entry is blanked and skipped when it surfaces.
    """

    def __init__(self) -> None:
        self._front: deque[Request] = deque()
        self._heap: list[list] = []  # [priority, arrival_order, tie, request | None]
        self._heap_entries: dict[str, list] = {}
        self._tie = itertools.count()  # keeps heap entries comparable

    def __len__(self) -> int:
        return len(self._front) + len(self._heap_entries)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __contains__(self, request: Request) -> bool:
        return request in self._front or request.request_id in self._heap_entries

    def push(self, request: Request) -> None:
        """Queue a new request by (priority, arrival order)."""
        entry = [request.priority, request.arrival_order, next(self._tie), request]
        self._heap_entries[request.request_id] = entry
        heapq.heappush(self._heap, entry)

    def push_front(self, request: Request) -> None:
        """Queue a preempted request ahead of everything else."""
        self._front.appendleft(request)

    def peek(self) -> Request:
        if self._front:
            return self._front[0]
        self._drop_removed_heads()
        if not self._heap:
            raise IndexError("peek from an empty waiting queue")
        return self._heap[0][3]

    def pop(self) -> Request:
        if self._front:
            return self._front.popleft()
        self._drop_removed_heads()
        if not self._heap:
            raise IndexError("pop from an empty waiting queue")
        request = heapq.heappop(self._heap)[3]
        del self._heap_entries[request.request_id]
        return request

    def remove(self, request: Request) -> None:
        entry = self._heap_entries.pop(request.request_id, None)
        if entry is not None:
            entry[3] = None
            return
        self._front.remove(request)  # rare (aborting a preempted request): O(n) is fine

    def __iter__(self) -> Iterator[Request]:
        """Requests in admission order (sorts the heap; for tests and stats)."""
        yield from self._front
        for entry in sorted(e for e in self._heap if e[3] is not None):
            yield entry[3]

    def _drop_removed_heads(self) -> None:
        while self._heap and self._heap[0][3] is None:
            heapq.heappop(self._heap)
