"""Stored responses (`store: true`, the default), in memory, for GET and DELETE /v1/responses/{id} and for
`previous_response_id`.

Each entry is the Response object as it was answered and the conversation it ends (the chat messages of every
input before it and its own output as the assistant's turn), so a chained request needs one lookup however long
the chain, and an evicted ancestor breaks nothing after it. The store is bounded twice: a number of responses
and a number of bytes (the answer's JSON plus the conversation's), the least recently used going first. An entry
belongs to the tenant that created it: to any other caller it does not exist (the same 404 as an unknown id).
"""
from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass

from tokenmill.serve.protocol import ChatMessage

log = logging.getLogger(__name__)

MAX_RESPONSES = 1000
MAX_BYTES = 128 << 20


@dataclass
class StoredResponse:
    owner: str | None  # the tenant's name; None without tenants (or for the admin and internal keys)
    body: str  # the Response object's JSON
    conversation: str  # JSON list of chat messages: the inputs so far and this response's output
    size: int

    def messages(self) -> list[ChatMessage]:
        return [ChatMessage.model_validate(m) for m in json.loads(self.conversation)]


def dump_conversation(messages: list[ChatMessage]) -> str:
    return json.dumps([m.model_dump(exclude_none=True) for m in messages])


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, owner: str | None, body: str, history: str) -> bool:
        """Store a response and its conversation (dump_conversation's JSON). False when the two alone are over the
        byte bound: the response is then not retrievable."""
        size = len(body) + len(history)
        if size > self.max_bytes:
            log.warning("response %s not stored: %d bytes, over the store's bound of %d", response_id, size,
                        self.max_bytes)
            return False
        self._drop(response_id)
        self._entries[response_id] = StoredResponse(owner, body, history, size)
        self.bytes += size
        while len(self._entries) > self.max_responses or self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        """The caller's own response (and it becomes the most recently used), else None."""
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str, owner: str | None) -> bool:
        if self.get(response_id, owner) is None:
            return False
        self._drop(response_id)
        return True

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
