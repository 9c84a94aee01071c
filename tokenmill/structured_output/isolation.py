"""The caller's llguidance check of a grammar, isolated in worker processes (`check_isolated`, `CheckerPool`):
a grammar that crashes or hangs the compile costs that request a 400 (the worker is killed and replaced),
never the server. A worker that cannot start is retried with backoff while grammar requests get 503
(`CheckerUnavailable`); the check never falls back into the server's process (only a platform without worker
processes checks here, on a StackPool thread). The worker program is checker_worker.py.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from tokenmill.structured_output.threads import COMPILE_STACK_BYTES, StackPool

log = logging.getLogger(__name__)

CHECK_WORKERS = 2  # worker processes (checks run in parallel up to this)
WORKER_START_TIMEOUT_S = 30.0
# The worker program: run by its path, so the server's packages are not imported into it.
WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checker_worker.py")

# A worker that failed to start is tried again after the first value, doubling up to the second: a host out of
# processes or file descriptors is not hammered, and one that recovers gets its checks back within a minute.
RESTART_BACKOFF_S = (1.0, 60.0)
# No worker processes at all on this platform: the checks run on threads here (the only in-process checks).
IN_PROCESS = os.name != "posix"


class CheckerUnavailable(RuntimeError):
    """No worker can check the grammar now (one is being restarted, or all are busy): the caller answers 503
    with Retry-After. Never a check in this process, and never a verdict to cache."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = max(1.0, retry_after_s)


@dataclass
class CheckerStatus:
    state: str  # "ok" | "restarting" (a worker could not start; retried with backoff) | "in_process"
    start_failures: int  # failed worker starts since this process began
    retry_in_s: float = 0.0  # restarting: until the next try
    last_error: str | None = None


class _Died(Exception):
    pass


class _Worker:
    """One checker process: a JSON line with a grammar in, a JSON line with llguidance's verdict out.
    OSError when it cannot start (no process, no file descriptors, no ready line within `start_timeout`)."""

    def __init__(self, command: list[str], start_timeout: float) -> None:
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, bufsize=0)
        self._buf = b""
        try:
            ready = self._read_line(time.monotonic() + start_timeout)
        except (_Died, ValueError):
            ready = None
        if ready != {"ready": True}:
            self.kill()
            raise OSError(f"the grammar checker process did not start within {start_timeout:g} s")

    def check(self, grammar: str, deadline: float) -> str:
        """llguidance's error ("" when valid); _Died when the process died or overran the deadline."""
        try:
            self.proc.stdin.write(json.dumps({"grammar": grammar}).encode() + b"\n")
        except OSError:
            raise _Died(f"exit code {self.proc.poll()}") from None
        return self._read_line(deadline)["error"]

    def _read_line(self, deadline: float) -> dict:
        import select

        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Died("timeout")
            readable, _, _ = select.select([fd], [], [], left)
            if readable:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise _Died(f"exit code {self.proc.wait(5)}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:  # pragma: no cover - a kill that does not take
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


class CheckerPool:
    """Up to `workers` checker processes, one check each at a time.

    A worker that crashes or overruns its check's deadline is killed, so a hanging grammar holds a worker for
    its timeout, never for good; the next check starts a new one. A worker that cannot start turns the pool
    "restarting": a thread of its own tries again with backoff, and meanwhile every check raises
    CheckerUnavailable at once. Checks never fall back into this process: the crash the workers exist to
    contain would take the server down."""

    def __init__(self, workers: int = CHECK_WORKERS, command: list[str] | None = None,
                 start_timeout: float = WORKER_START_TIMEOUT_S, backoff: tuple[float, float] = RESTART_BACKOFF_S):
        self.workers = workers
        self.command = command or [sys.executable, WORKER_SCRIPT]
        self.start_timeout = start_timeout
        self.backoff = backoff
        self._slots = threading.BoundedSemaphore(workers)
        self._cond = threading.Condition()  # guards everything below
        self._idle: list[_Worker] = []
        self._restarting = False
        self._restarter: threading.Thread | None = None
        self._retry_at = 0.0
        self._streak = 0  # failed starts in a row
        self._error: str | None = None
        self._closed = False
        self.start_failures = 0

    # ---- what callers use ------------------------------------------------------------------
    def check(self, grammar: str, timeout: float) -> str:
        """llguidance's check of `grammar` ("" valid, else the error) in a worker, within `timeout`: a grammar
        that crashes or hangs the check costs that worker, never this process. CheckerUnavailable when no
        worker can take it (restarting, or all busy for the whole timeout)."""
        self._refuse_while_restarting()
        if not self._slots.acquire(timeout=timeout):
            raise CheckerUnavailable(f"all {self.workers} grammar checkers stayed busy for {timeout:g} s.")
        try:
            worker = self._take()
            deadline = time.monotonic() + timeout  # the check's own time: a slow start is not the grammar's fault
            try:
                error = worker.check(grammar, deadline)
            except _Died as e:
                worker.kill()
                if str(e) == "timeout":
                    return f"it did not compile within {timeout:g} s."
                return f"checking it crashed the grammar checker ({e}); it is too large or too deeply nested."
            with self._cond:
                self._idle.append(worker)
            return error
        finally:
            self._slots.release()

    def status(self) -> CheckerStatus:
        with self._cond:
            if not self._restarting:
                return CheckerStatus("ok", self.start_failures)
            return CheckerStatus("restarting", self.start_failures, max(0.0, self._retry_at - time.monotonic()),
                                 self._error)

    def wait_ready(self, timeout: float) -> bool:
        """Until no restart is pending (False when `timeout` passes first)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._restarting, timeout)

    def close(self) -> None:
        """Stop the workers and the restarter (tests; at exit the workers see their input close)."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            restarter = self._restarter
            self._cond.notify_all()
        for w in idle:
            w.kill()
        if restarter is not None:
            restarter.join(self.start_timeout + 5)

    # ---- workers ---------------------------------------------------------------------------
    def _take(self) -> _Worker:
        """An idle live worker, else a new one (CheckerUnavailable when it cannot start)."""
        while True:
            with self._cond:
                worker = self._idle.pop() if self._idle else None
            if worker is None:
                break
            if worker.alive():
                return worker
            worker.kill()
        self._refuse_while_restarting()  # a restart may have begun while this waited for its slot
        try:
            return _Worker(self.command, self.start_timeout)
        except Exception as e:  # OSError mostly (EMFILE, EAGAIN, ENOENT, no ready line); whatever it is, retry
            self._start_failed(e)
            raise CheckerUnavailable("the grammar checker process did not start; retry shortly.",
                                     self.backoff[0] + 1.0) from None

    def _refuse_while_restarting(self) -> None:
        with self._cond:
            if not self._restarting:
                return
            left = self._retry_at - time.monotonic()
            if self._restarter is None and not self._closed:  # its thread could not start: try again now
                self._start_restarter_locked()
        # The cause (a path, an errno) is for the log and checker_status, not for callers.
        raise CheckerUnavailable("the grammar checker process is restarting; retry shortly.", left + 1.0)

    def _start_failed(self, e: BaseException) -> None:
        log.warning("the grammar checker process did not start (%s: %s); grammar requests are refused with 503 "
                    "until it does", type(e).__name__, e)
        with self._cond:
            self.start_failures += 1
            self._error = f"{type(e).__name__}: {e}"
            if self._restarting:
                return
            self._restarting, self._streak = True, 1
            self._retry_at = time.monotonic() + self.backoff[0]
            self._start_restarter_locked()

    def _start_restarter_locked(self) -> None:
        try:
            t = threading.Thread(target=self._restart_loop, name="tokenmill-grammar-restart", daemon=True)
            t.start()
        except RuntimeError:  # no thread either: the next check tries to start one again
            return
        self._restarter = t

    def _restart_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (left := self._retry_at - time.monotonic()) > 0:
                    self._cond.wait(left)
                if self._closed:
                    self._restarter = None
                    return
            try:
                worker = _Worker(self.command, self.start_timeout)
            except Exception as e:
                with self._cond:
                    self.start_failures += 1
                    self._error = f"{type(e).__name__}: {e}"
                    wait = min(self.backoff[1], self.backoff[0] * 2 ** self._streak)
                    self._streak += 1
                    self._retry_at = time.monotonic() + wait
                    self._cond.notify_all()  # status readers
                log.warning("the grammar checker process did not start again (%s: %s); next try in %.0f s",
                            type(e).__name__, e, wait)
                continue
            with self._cond:
                self._idle.append(worker)
                failed, self._streak = self._streak, 0
                self._restarting, self._restarter, self._error = False, None, None
                self._cond.notify_all()
            log.info("the grammar checker process started after %d failed start(s)", failed)
            return


_pool = CheckerPool()
_local_pool: StackPool | None = None


def check_isolated(grammar: str, timeout: float) -> str:
    """llguidance's check of `grammar` ("" valid, else the error), in a worker process (CheckerPool.check).
    Only where this platform has no worker support at all does it run on a thread here."""
    if IN_PROCESS:
        return _check_here(grammar, timeout)
    return _pool.check(grammar, timeout)


def checker_status() -> CheckerStatus:
    """The grammar checker's state, for /health and /metrics."""
    if IN_PROCESS:
        return CheckerStatus("in_process", 0)
    return _pool.status()


def _check_here(grammar: str, timeout: float) -> str:
    global _local_pool
    import llguidance

    if _local_pool is None:
        _local_pool = StackPool(CHECK_WORKERS, COMPILE_STACK_BYTES, "grammar-check")
    future = _local_pool.submit(llguidance.LLMatcher.validate_grammar, grammar)
    try:
        return future.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        return f"it did not compile within {timeout:g} s."
