"""Responses kept for `GET /v1/responses/{id}` and `previous_response_id`: in memory, at most
`serving_config.responses_store_size` of them, each for `responses_ttl_s` after it was made (the
oldest go first when full). A response made with `store: false` is never kept."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class Stored:
    response: dict[str, Any]  # the response object, as returned
    conversation: list[dict[str, Any]]  # its chat messages, input and output (no instructions): what a follow-up continues
    expires: float


class ResponseStore:
    def __init__(self, size: int, ttl_s: float):
        self.size, self.ttl_s = size, ttl_s
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        with self._lock:
            self._expire(time.monotonic())
            self._items[response["id"]] = Stored(response, conversation, time.monotonic() + self.ttl_s)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, rid: str) -> Stored | None:
        with self._lock:
            self._expire(time.monotonic())
            return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._items.pop(rid, None) is not None

    def _expire(self, now: float) -> None:
        while self._items and next(iter(self._items.values())).expires <= now:
            self._items.popitem(last=False)
