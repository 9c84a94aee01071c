"""Threads with a chosen stack size: `start_thread` and `StackPool`, a ThreadPoolExecutor whose threads have
it. llguidance's compile recurses (see limits.py), so the stack decides how deep a grammar it survives.

Standard library only: the checker worker (checker_worker.py) loads this file by its path.
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Callable

CHECK_STACK_BYTES = 8 << 20  # the worker's check thread: the stack the limits were measured on
COMPILE_STACK_BYTES = 64 << 20  # compile threads in the core: 8x the check's, so what passed compiles

_stack_lock = threading.Lock()


def start_thread(target: Callable[[], None], name: str, stack_bytes: int) -> threading.Thread:
    """A daemon thread with a `stack_bytes` stack (threading.stack_size is process-wide: set, start, restore)."""
    with _stack_lock:
        try:
            old = threading.stack_size(stack_bytes)
        except (ValueError, RuntimeError):  # a platform that cannot: the default stack
            old = None
        try:
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
        finally:
            if old is not None:
                threading.stack_size(old)
    return t


class StackPool:
    """A fixed set of threads with a chosen stack size, ThreadPoolExecutor's submit/shutdown (the threads
    start on the first submit)."""

    def __init__(self, workers: int, stack_bytes: int, name: str) -> None:
        self._workers, self._stack, self._name = workers, stack_bytes, name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._started = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        with self._lock:
            if not self._started:
                for i in range(self._workers):
                    start_thread(self._run, f"{self._name}-{i}", self._stack)
                self._started = True
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # the caller's future carries it
                future.set_exception(e)

    def shutdown(self, wait: bool = False, cancel_futures: bool = True) -> None:
        while cancel_futures:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(self._workers if self._started else 0):
            self._queue.put(None)
