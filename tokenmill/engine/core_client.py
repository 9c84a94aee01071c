"""Clients of the engine core for the server: the core in a thread of this process, or in its own process.

Both speak the messages of core_proc.py and never block their caller: `send` and `send_requests` only queue
(the event loop calls them), `get()` returns what the core sent, and raises CoreDeadError once the core is
gone (a crashed process: the pipe closes), so no caller waits forever.

IPC is `multiprocessing` pipes with pickle, no extra dependency. Payloads are not always small: a request's
prompt ids (n copies of them for n > 1), a step's prompt logprobs (rows x top-k), a large grammar. So each
side moves them on threads of its own (issue 24). Here a sender thread drains a queue bounded by bytes into
the pipe, pickling everything waiting as one frame (the n copies of a prompt are written once), and a
receiver thread reads frames as they come into a queue that `get()` drains. In the core an input thread and
an output thread do the same (core_proc.py). A full send queue refuses new requests (CoreBusyError: the
server answers 503 with Retry-After) rather than waiting; aborts, utility calls and shutdown are always
taken. Pickling a 7,000-id prompt costs ~0.2 ms; ZeroMQ + msgspec (vLLM's choice) pays off at thousands of
requests per second per core, which a CPU step loop does not reach.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import threading

from tokenmill.config import EngineConfig
from tokenmill.engine.core_proc import (JOIN_TIMEOUT_S, OUTBOX_BYTES, QueueInbox, core_process_main, dump_frame,
                                        load_frame, message_size, output_size, run_core_loop)

log = logging.getLogger(__name__)

CORE_START_TIMEOUT_S = 900.0
# How long a core still starting gets to exit after its pipe closes (it is interrupted at once, but a step
# of the load in C code, e.g. reading a large tensor, finishes first).
CORE_STOP_TIMEOUT_S = 30.0
# Adds queued for the core, not yet taken by it (or by the sender thread), before new requests are refused.
SEND_QUEUE_BYTES = 64 << 20
# A frame to the core holds about this much at most: pickling holds the GIL, the event loop's too.
FRAME_BYTES = 4 << 20
# Messages read from the core ahead of the output thread before the receiver stops reading (then the core's
# own output queue fills, and it holds its steps).
RECV_QUEUE_BYTES = 256 << 20


class CoreDeadError(RuntimeError):
    pass


class CoreBusyError(RuntimeError):
    """The queue to the core is full: the request is refused now (503), it may be retried shortly."""


def requests_size(reqs: list) -> int:
    """The bytes a request's n copies cost on the way to the core: they share one list of prompt ids."""
    return message_size(("add", reqs[0])) + 512 * (len(reqs) - 1)


class CoreClient:
    info = None  # executor.worker.WorkerInfo, once ready
    closed = False  # shutdown() has begun: the core going away is expected

    def send(self, msg: tuple) -> None:
        """Queue a message for the core (never blocks, never refused); CoreDeadError once it is gone."""
        raise NotImplementedError

    def send_requests(self, reqs: list) -> None:
        """Queue ("add", r) for each of a request's copies, all or none; CoreBusyError when the queue is full."""
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
    """The core in a background thread (steps release the GIL in torch, but everything else competes).

    Its outputs wait in a queue bounded as the process core's are (OUTBOX_BYTES): when the output thread falls
    that far behind, the loop stops stepping (and keeps taking commands) until it catches up."""

    def __init__(self, config_or_core, outbox_bytes: int = OUTBOX_BYTES) -> None:
        core = config_or_core
        self._owns_core = isinstance(core, EngineConfig)
        if self._owns_core:
            from tokenmill.engine.core import EngineCore

            core = EngineCore(core)
        self.core = core
        self.info = self.core.info
        self.inbox = QueueInbox(SEND_QUEUE_BYTES)
        self.outbox = QueueInbox(outbox_bytes)
        self._thread: threading.Thread | None = None
        self._dead: str | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tokenmill-engine-core", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            run_core_loop(self.core, self.inbox, self._put_output, lambda: not self.outbox.full)
        except BaseException as e:  # never silently: the server must turn unhealthy
            log.exception("engine core thread died")
            self._dead = f"{type(e).__name__}: {e}"
            self.outbox.put(("dead", (self._dead, "")))

    def _put_output(self, msg: tuple) -> None:
        self.outbox.put(msg, output_size(msg))  # always taken: the loop holds its next step while it is full

    def send(self, msg: tuple) -> None:
        if self._dead is not None:
            raise CoreDeadError(self._dead)
        self.inbox.put(msg, message_size(msg))

    def send_requests(self, reqs: list) -> None:
        if self._dead is not None:
            raise CoreDeadError(self._dead)
        if not self.inbox.put_all([("add", r) for r in reqs], requests_size(reqs)):
            raise CoreBusyError(f"{self.inbox.nbytes} bytes of requests are waiting for the engine core.")

    def get(self, timeout: float | None = None) -> list[tuple]:
        return self.outbox.get(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        self.closed = True
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
        self._dead: str | None = None
        try:
            kind, payload = self._wait_ready()
        except BaseException:  # e.g. Ctrl-C while the model loads: the core sees its pipe close and exits
            self._abandon_start()
            raise
        if kind != "ready":
            self.proc.join(5.0)
            message, tb = payload
            log.debug("engine core failed to start:\n%s", tb)
            name, _, text = message.partition(": ")
            raise {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}.get(name, RuntimeError)(
                text if name in ("ValueError", "FileNotFoundError") else message)
        self.info = payload
        self._outgoing = QueueInbox(SEND_QUEUE_BYTES)
        self._incoming = QueueInbox(RECV_QUEUE_BYTES)
        self._sender = threading.Thread(target=self._send_loop, name="tokenmill-core-sender", daemon=True)
        self._receiver = threading.Thread(target=self._receive_loop, name="tokenmill-core-receiver", daemon=True)
        self._sender.start()
        self._receiver.start()
        # A caller that exits without shutdown(): multiprocessing's exit handler would wait forever for the core,
        # which waits for this end of the pipe to close. Registered after multiprocessing's, so it runs first.
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        self.shutdown(JOIN_TIMEOUT_S)

    def _abandon_start(self) -> None:
        """Stop a core that is still starting: it ignores SIGINT and SIGTERM (the server stops it), but it
        watches its pipe while it starts, and on its closing exits through its own cleanup."""
        self.conn.close()
        self.proc.join(CORE_STOP_TIMEOUT_S)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(2.0)

    def _wait_ready(self) -> tuple:
        waited = 0.0
        while not self.conn.poll(0.2):
            waited += 0.2
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine core process died while starting (exit code {self.proc.exitcode}).")
            if waited > CORE_START_TIMEOUT_S:
                self.proc.kill()
                raise RuntimeError(f"the engine core process did not start in {CORE_START_TIMEOUT_S:.0f} s.")
        try:
            return load_frame(self.conn.recv_bytes())[0]
        except EOFError:  # it died before a word (e.g. it could not import this program's main module)
            self.proc.join(5.0)
            raise RuntimeError(f"the engine core process died while starting (exit code {self.proc.exitcode}).") \
                from None

    # ---- the two threads that touch the pipe ---------------------------------------------
    def _send_loop(self) -> None:
        """What is queued goes as one frame, up to FRAME_BYTES (pickle writes objects shared by its messages,
        such as the prompt ids of n copies, once)."""
        try:
            while True:
                self.conn.send_bytes(dump_frame(self._outgoing.get(None, FRAME_BYTES)))
        except EOFError:  # shut down, and everything queued was sent
            pass
        except OSError:
            self._dead = self._dead or self._death()
            self._outgoing.close()

    def _receive_loop(self) -> None:
        try:
            while True:
                data = self.conn.recv_bytes()
                msgs = load_frame(data)
                while not self._incoming.wait_room(1.0):  # the output thread is far behind: the core holds steps
                    pass
                self._incoming.put_all(msgs, len(data), force=True)
        except (EOFError, OSError):
            pass
        except Exception:  # an unreadable frame: a bug; the output thread must still hear the core is lost
            log.exception("reading from the engine core failed")
        finally:
            self._incoming.close()

    # ---- what callers use ------------------------------------------------------------------
    def _check_alive(self) -> None:
        """CoreDeadError once the process is gone: a message queued for a dead core would never be answered."""
        if self._dead is None and not self.proc.is_alive():
            self._dead = f"the engine core process died (exit code {self.proc.exitcode})."
        if self._dead is not None:
            raise CoreDeadError(self._dead)

    def send(self, msg: tuple) -> None:
        self._check_alive()
        self._outgoing.put(msg, message_size(msg))

    def send_requests(self, reqs: list) -> None:
        self._check_alive()
        if not self._outgoing.put_all([("add", r) for r in reqs], requests_size(reqs)):
            raise CoreBusyError(f"{self._outgoing.nbytes} bytes of requests are waiting to reach the engine core.")

    def get(self, timeout: float | None = None) -> list[tuple]:
        try:
            msgs = self._incoming.get(timeout)
        except EOFError:  # the pipe closed and everything the core sent has been read
            raise CoreDeadError(self._death()) from None
        if not msgs and not self.proc.is_alive():
            self._receiver.join(0.5)  # it reads what the core said last, then sees the pipe close
            if self._receiver.is_alive():  # something else holds the pipe open: the core is gone all the same
                raise CoreDeadError(self._death())
        return msgs

    def _death(self) -> str:
        self.proc.join(0.5)
        return f"the engine core process died (exit code {self.proc.exitcode})."

    @property
    def is_alive(self) -> bool:
        return self.proc.is_alive() and self._dead is None

    def shutdown(self, timeout: float = 10.0) -> None:
        atexit.unregister(self._at_exit)
        self.closed = True
        # Keep reading whatever the core still writes (nobody may be calling get() now), so its output thread
        # never blocks on its way out.
        self._incoming.close()
        if self.proc.is_alive():
            try:
                self.send(("shutdown", None))
            except CoreDeadError:
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(2.0)
        self._outgoing.close()
        self._sender.join(JOIN_TIMEOUT_S)
        self._receiver.join(JOIN_TIMEOUT_S)
        self.conn.close()


def make_core_client(config: EngineConfig, own_process: bool) -> CoreClient:
    return ProcessCoreClient(config) if own_process else ThreadCoreClient(config)
