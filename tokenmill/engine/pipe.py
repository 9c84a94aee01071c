"""The wire between the engine core and its clients, one copy for both ends: frames (a pickled list of messages),
byte-bounded queues between threads, and the two threads that touch a pipe (a reader that queues the frames it
reads, a writer that writes what is queued), so no thread that matters ever waits on the pipe (issue 24).

The core process (core_proc.py) reads commands and writes outputs with them; the process client
(core_client.py) writes commands and reads outputs with the same classes; the thread client hands its queues to
the core loop directly.
"""
from __future__ import annotations

import collections
import logging
import pickle
import threading
from typing import Callable

log = logging.getLogger(__name__)

# How long the threads get to finish at exit (the core's own exit, or the client's shutdown).
JOIN_TIMEOUT_S = 5.0


def dump_frame(msgs: list[tuple]) -> bytes:
    return pickle.dumps(msgs, protocol=pickle.HIGHEST_PROTOCOL)


def load_frame(data: bytes) -> list[tuple]:
    return pickle.loads(data)


def message_size(msg: tuple) -> int:
    """Roughly what a message costs to hold and to move, in bytes (an add: its prompt ids; the rest is small).
    Only for bounding queues: no pickling, O(1)."""
    kind, payload = msg
    if kind == "add":
        return 512 + 4 * len(payload.prompt_token_ids)
    return 256


class Inbox:
    """Commands for the loop: `get(timeout)` returns all waiting ones (waiting up to timeout for the first;
    None: forever). Raises EOFError when the sender is gone."""

    def get(self, timeout: float | None) -> list:
        raise NotImplementedError


class QueueInbox(Inbox):
    """A FIFO between threads that counts what it holds, in bytes as the caller sizes them. `put` never
    blocks: with `limit`, it refuses what does not fit (unless forced); `wait_room` is for a producer that
    may wait. After `close()` the consumer gets what is left, then EOFError."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self._items: collections.deque = collections.deque()  # (message, its bytes)
        self._bytes = 0
        self._closed = False
        self._cond = threading.Condition()

    @property
    def nbytes(self) -> int:
        return self._bytes

    @property
    def full(self) -> bool:
        return self.limit is not None and self._bytes >= self.limit

    def put(self, msg, size: int = 0) -> None:
        """Always accepted (what must never be refused: aborts, shutdown, outputs)."""
        self.put_all([msg], size, force=True)

    def put_all(self, msgs: list, size: int = 0, force: bool = False) -> bool:
        """All of `msgs` (together `size` bytes) or none: False when the queue is at its limit. A queue under
        its limit takes any one batch, so a request larger than the limit still gets through alone."""
        with self._cond:
            if not force and self.full:
                return False
            self._items.extend((m, size if i == 0 else 0) for i, m in enumerate(msgs))
            self._bytes += size
            self._cond.notify_all()
            return True

    def wait_room(self, timeout: float) -> bool:
        """Wait until the queue is under its limit (or closed); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self.full or self._closed, timeout)

    def get(self, timeout: float | None, max_bytes: int | None = None) -> list:
        """Everything waiting (with max_bytes: the oldest messages up to about that many bytes, at least one
        batch of put_all: its later messages count 0 bytes and always come with the first)."""
        with self._cond:
            if not self._items:
                if self._closed:
                    raise EOFError
                self._cond.wait_for(lambda: self._items or self._closed, timeout)
                if not self._items:
                    if self._closed:
                        raise EOFError
                    return []
            msgs, taken = [], 0
            while self._items and (max_bytes is None or not msgs or taken + self._items[0][1] <= max_bytes
                                   or self._items[0][1] == 0):
                msg, size = self._items.popleft()
                msgs.append(msg)
                taken += size
            self._bytes -= taken
            self._cond.notify_all()  # room again
            return msgs

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class PipeReader:
    """A thread that reads frames from the pipe as they arrive into `inbox`, which another thread drains (the
    core's loop between steps; the client's output thread). When the pipe closes (the other side is gone) the
    inbox closes, and its consumer hears EOFError after the last message."""

    def __init__(self, conn, limit: int | None, name: str, failure: str) -> None:
        self.conn = conn
        self.failure = failure  # logged when a frame cannot be read
        self.inbox = QueueInbox(limit)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                data = self.conn.recv_bytes()
                msgs = load_frame(data)
                # Over the limit, stop reading until the consumer catches up: the pipe fills and the writer's own
                # bounded queue takes the back-pressure. What must get through (shutdown, aborts) still does once
                # there is room.
                while not self.inbox.wait_room(1.0):
                    pass
                self.inbox.put_all(msgs, len(data), force=True)
        except (EOFError, OSError):
            pass
        except Exception:  # an unreadable frame: a bug, but the consumer must hear that the input is gone
            log.exception(self.failure)
        finally:
            self.inbox.close()


class PipeWriter:
    """A thread that writes what is queued on `outbox` to the pipe, so the sending thread never waits for the
    reader. Two ways to queue, one per side:
      - `send(msg)` pickles the message now, in the sender's thread: the frame is a snapshot of its objects as
        they are then, and its size is exact; frames go out one at a time (the core's outputs: what waits
        unwritten is the backlog the loop watches);
      - `frame_bytes` set: `outbox` holds messages (put there with their sizes, message_size), and the writer
        pickles everything waiting, up to frame_bytes, as one frame: pickle writes objects the messages share,
        such as the prompt ids of a request's n copies, once (the client's commands).
    When the pipe breaks (the other side is gone) `broken` is set, the outbox closes and `on_broken` runs."""

    def __init__(self, conn, limit: int | None, name: str, frame_bytes: int | None = None,
                 on_broken: Callable[[], None] | None = None) -> None:
        self.conn = conn
        self.frame_bytes = frame_bytes
        self.on_broken = on_broken
        self.outbox = QueueInbox(limit)
        self.broken = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def send(self, msg: tuple) -> None:
        data = dump_frame([msg])
        self.outbox.put(data, len(data))

    @property
    def backlog(self) -> bool:
        """The reader has fallen `limit` bytes behind (and is still there)."""
        return self.outbox.full and not self.broken

    def _run(self) -> None:
        try:
            while True:
                if self.frame_bytes is None:
                    for data in self.outbox.get(None, max_bytes=1):  # one frame at a time: the rest is backlog
                        self.conn.send_bytes(data)
                else:
                    self.conn.send_bytes(dump_frame(self.outbox.get(None, self.frame_bytes)))
        except EOFError:  # closed, and everything queued was written
            pass
        except OSError:  # the other side is gone; its reader (or our own) sees it too
            self.broken = True
            self.outbox.close()
            if self.on_broken is not None:
                self.on_broken()

    def close(self, timeout: float = JOIN_TIMEOUT_S) -> None:
        """Write out what is queued (up to timeout), then stop."""
        self.outbox.close()
        self.thread.join(timeout)
