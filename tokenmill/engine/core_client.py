"""Clients of the engine core for the server: the core in a thread of this process, or in its own process.

Both speak the messages of core_proc.py; `get()` returns what the core sent, and raises CoreDeadError
once the core is gone (a crashed process: the pipe closes), so no caller waits forever.

IPC is `multiprocessing` pipes with pickle: no extra dependency, and the payloads are small (a step's
new token ids and stats, a request's prompt ids once), so pickling costs microseconds next to a step of
milliseconds. ZeroMQ + msgspec (vLLM's choice) pays off at thousands of requests per second per core,
which a CPU step loop does not reach.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import threading

from tokenmill.config import EngineConfig
from tokenmill.engine.core_proc import QueueInbox, core_process_main, run_core_loop

log = logging.getLogger(__name__)

CORE_START_TIMEOUT_S = 900.0


class CoreDeadError(RuntimeError):
    pass


class CoreClient:
    info = None  # executor.worker.WorkerInfo, once ready

    def send(self, msg: tuple) -> None:
        raise NotImplementedError

    def get(self, timeout: float | None = None) -> list[tuple]:
        """Messages from the core (waits up to timeout for the first; [] on timeout)."""
        raise NotImplementedError

    @property
    def is_alive(self) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        pass

    def shutdown(self, timeout: float = 10.0) -> None:
        raise NotImplementedError


class ThreadCoreClient(CoreClient):
    """The core in a background thread (steps release the GIL in torch, but everything else competes)."""

    def __init__(self, config_or_core) -> None:
        from tokenmill.engine.core import EngineCore

        core = config_or_core
        self._owns_core = not isinstance(core, EngineCore)
        self.core = EngineCore(core) if self._owns_core else core
        self.info = self.core.info
        self.inbox = QueueInbox()
        self.outbox = QueueInbox()
        self._thread: threading.Thread | None = None
        self._dead: str | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tokenmill-engine-core", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            run_core_loop(self.core, self.inbox, self.outbox.put)
        except BaseException as e:  # never silently: the server must turn unhealthy
            log.exception("engine core thread died")
            self._dead = f"{type(e).__name__}: {e}"
            self.outbox.put(("dead", (self._dead, "")))

    def send(self, msg: tuple) -> None:
        if self._dead is not None:
            raise CoreDeadError(self._dead)
        self.inbox.put(msg)

    def get(self, timeout: float | None = None) -> list[tuple]:
        return self.outbox.get(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self.inbox.put(("shutdown", None))
            self._thread.join(timeout)
        if self._owns_core:
            self.core.shutdown()


class ProcessCoreClient(CoreClient):
    """The core in its own process: HTTP, tokenizing and detokenizing never hold the step loop's GIL."""

    def __init__(self, config: EngineConfig) -> None:
        ctx = mp.get_context("spawn")  # fork after torch has started threads is unsafe
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=core_process_main, args=(config, child), name="tokenmill-engine-core")
        self.proc.start()
        child.close()
        self._send_lock = threading.Lock()
        msgs = self._wait_ready()
        kind, payload = msgs
        if kind != "ready":
            self.proc.join(5.0)
            message, tb = payload
            log.debug("engine core failed to start:\n%s", tb)
            name, _, text = message.partition(": ")
            raise {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}.get(name, RuntimeError)(
                text if name in ("ValueError", "FileNotFoundError") else message)
        self.info = payload

    def _wait_ready(self) -> tuple:
        waited = 0.0
        while not self.conn.poll(0.2):
            waited += 0.2
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine core process died while starting (exit code {self.proc.exitcode}).")
            if waited > CORE_START_TIMEOUT_S:
                self.proc.kill()
                raise RuntimeError(f"the engine core process did not start in {CORE_START_TIMEOUT_S:.0f} s.")
        return self.conn.recv()

    def send(self, msg: tuple) -> None:
        try:
            with self._send_lock:
                self.conn.send(msg)
        except (BrokenPipeError, OSError, EOFError):
            raise CoreDeadError(self._death()) from None

    def get(self, timeout: float | None = None) -> list[tuple]:
        try:
            if not self.conn.poll(timeout):
                if not self.proc.is_alive():
                    raise CoreDeadError(self._death())
                return []
            msgs = [self.conn.recv()]
            while self.conn.poll(0):
                msgs.append(self.conn.recv())
            return msgs
        except (EOFError, OSError):
            raise CoreDeadError(self._death()) from None

    def _death(self) -> str:
        self.proc.join(0.5)
        return f"the engine core process died (exit code {self.proc.exitcode})."

    @property
    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self.proc.is_alive():
            try:
                self.send(("shutdown", None))
            except CoreDeadError:
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(2.0)
        self.conn.close()


def make_core_client(config: EngineConfig, own_process: bool) -> CoreClient:
    return ProcessCoreClient(config) if own_process else ThreadCoreClient(config)
