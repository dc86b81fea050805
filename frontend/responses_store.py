"""Stored responses of the Responses API (`store: true`, OpenAI's default): what
GET /v1/responses/{id} returns and what `previous_response_id` continues.

Kept in this frontend's memory, newest first, up to a bound (the oldest is
forgotten): a restart, or another frontend, does not know them, as vLLM's
in-memory store."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_STORED_RESPONSES = 1000


@dataclass(frozen=True, slots=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as returned
    conversation: list[dict[str, Any]]  # chat messages up to and including its output, without instructions
    input_items: list[dict[str, Any]]  # the items it was made from, oldest first (GET .../input_items)


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_STORED_RESPONSES):
        self.max_responses = max_responses
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, stored: StoredResponse) -> None:
        if self.max_responses <= 0:
            return
        self._responses[stored.body["id"]] = stored
        self._responses.move_to_end(stored.body["id"])
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)  # continued conversations stay
        return stored

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None
