"""The waiting queue: requests waiting for admission, in their scheduling policy's order. No torch here."""
from __future__ import annotations

import bisect
import itertools
import time
from typing import Callable

from tokenmill.core.request import Request


class WaitingQueue:
    """Requests ordered by their policy's queue key (smallest first), ties in insertion order."""

    def __init__(self, key: Callable[[Request, float], tuple], clock: Callable[[], float] = time.monotonic) -> None:
        self._key = key
        self._clock = clock
        self._keys: list[tuple] = []
        self._reqs: list[Request] = []
        self._counter = itertools.count()

    def key(self, req: Request) -> tuple:
        return self._key(req, self._clock())

    def add(self, req: Request) -> None:
        k = (*self.key(req), next(self._counter))
        i = bisect.bisect(self._keys, k)
        self._keys.insert(i, k)
        self._reqs.insert(i, req)

    def resort(self, now: float) -> None:
        """Recompute every key (for policies whose order changes with time), keeping ties in their order."""
        keyed = sorted(((*self._key(r, now), k[-1]), r) for k, r in zip(self._keys, self._reqs))
        self._keys = [k for k, _ in keyed]
        self._reqs = [r for _, r in keyed]

    def items(self):
        """(key, request) pairs in order (the key without its tie-breaking counter)."""
        return ((k[:-1], r) for k, r in zip(self._keys, self._reqs))

    def peek(self) -> Request:
        return self._reqs[0]

    def pop(self) -> Request:
        self._keys.pop(0)
        return self._reqs.pop(0)

    def remove(self, req: Request) -> bool:
        for i, r in enumerate(self._reqs):
            if r is req:
                del self._keys[i], self._reqs[i]
                return True
        return False

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self):
        return iter(self._reqs)
