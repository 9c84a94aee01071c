"""What the prefix cache holds, as events for a cache-aware router (as vLLM's KV events): a block named
("stored": its KV can be shared by a later request with the same prefix) or dropped ("removed": evicted,
reset, or its content not trusted). Sequence-numbered and bounded; a reader that fell behind the buffer
gets a snapshot of every cached hash instead. Hashes are core/kv_cache.hash_block's, hex-encoded, so a
router that tokenizes a prompt can compute the same chain and ask who holds it. No torch."""
from __future__ import annotations

from collections import deque
from typing import Callable, Iterable

MAX_EVENTS = 1 << 16


class KVEventLog:
    def __init__(self, maxlen: int = MAX_EVENTS) -> None:
        self.seq = 0
        self.events: deque[tuple[int, str, bytes]] = deque(maxlen=maxlen)

    def stored(self, h: bytes) -> None:
        self.seq += 1
        self.events.append((self.seq, "stored", h))

    def removed(self, h: bytes) -> None:
        self.seq += 1
        self.events.append((self.seq, "removed", h))

    def since(self, seq: int, snapshot: Callable[[], Iterable[bytes]]) -> dict:
        """Events after `seq` (0: from the start). When they are no longer all buffered (or seq is from
        another run), `reset` is true and `stored` lists every hash cached now: replace, do not merge."""
        oldest = self.events[0][0] if self.events else self.seq + 1
        if seq < 0 or seq > self.seq or (seq + 1 < oldest and seq < self.seq):
            return {"last_seq": self.seq, "reset": True, "events": [],
                    "stored": [h.hex() for h in snapshot()]}
        events = [[s, kind, h.hex()] for s, kind, h in self.events if s > seq]
        return {"last_seq": self.seq, "reset": False, "events": events}
