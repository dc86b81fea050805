"""The in-memory store of the Responses API keeps the latest responses up to its
bound: the least recently used goes first, and continuing one keeps it."""
from __future__ import annotations

from frontend.responses_store import ResponseStore, StoredResponse


def stored(response_id: str) -> StoredResponse:
    return StoredResponse({"id": response_id}, [], [])


def test_the_least_recently_used_response_is_forgotten_first():
    store = ResponseStore(max_responses=2)
    store.put(stored("resp_a"))
    store.put(stored("resp_b"))
    assert store.get("resp_a") is not None  # continued: now the most recent
    store.put(stored("resp_c"))
    assert len(store) == 2 and store.get("resp_b") is None
    assert store.get("resp_a") is not None and store.get("resp_c") is not None
    assert store.delete("resp_a") and not store.delete("resp_a") and len(store) == 1


def test_a_bound_of_zero_stores_nothing():
    store = ResponseStore(max_responses=0)
    store.put(stored("resp_a"))
    assert len(store) == 0 and store.get("resp_a") is None
