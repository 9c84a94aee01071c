"""Clients of the engine core for the server: the core in a thread of this process, or in its own process.

Both speak the messages of core_proc.py and never block their caller: `send` and `send_requests` only queue
(the event loop calls them), `get()` returns what the core sent, and raises CoreDeadError once the core is
gone (a crashed process: the pipe closes), so no caller waits forever.

IPC is `multiprocessing` pipes with pickle, no extra dependency. Payloads are not always small: a request's
prompt ids (n copies of them for n > 1), a step's prompt logprobs (rows x top-k), a large grammar. So each
side moves them on threads of its own (issue 24). Here a sender thread drains a queue bounded by bytes into
the pipe, pickling everything waiting as one frame (the n copies of a prompt are written once), and a
receiver thread reads frames as they come into a queue that `get()` drains. In the core an input thread and
an output thread do the same, with the same classes (pipe.py); the thread client hands its two queues to the
core loop itself. Either way `send`, `send_requests` and `get` are the base class's, over those queues. A full send queue refuses new requests (CoreBusyError: the
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
from tokenmill.engine.core_proc import OUTBOX_BYTES, core_process_main, output_size, run_core_loop
from tokenmill.engine.pipe import JOIN_TIMEOUT_S, PipeReader, PipeWriter, QueueInbox, load_frame, message_size

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
    """What the server's engine holds: messages to the core go on `_to_core`, its answers come from `_from_core`
    (the core loop's own queues for a core in a thread; the pipe threads' queues for a core process)."""

    info = None  # executor.worker.WorkerInfo, once ready
    closed = False  # shutdown() has begun: the core going away is expected
    _to_core: QueueInbox
    _from_core: QueueInbox

    def _check_alive(self) -> None:
        """CoreDeadError once the core is gone: a message queued for a dead core would never be answered."""
        raise NotImplementedError

    def _death(self) -> str:
        """Why the core is gone, once its answers have ended."""
        raise NotImplementedError

    def send(self, msg: tuple) -> None:
        """Queue a message for the core (never blocks, never refused); CoreDeadError once it is gone."""
        self._check_alive()
        self._to_core.put(msg, message_size(msg))

    def send_requests(self, reqs: list) -> None:
        """Queue ("add", r) for each of a request's copies, all or none; CoreBusyError when the queue is full."""
        self._check_alive()
        if not self._to_core.put_all([("add", r) for r in reqs], requests_size(reqs)):
            raise CoreBusyError(f"{self._to_core.nbytes} bytes of requests are waiting to reach the engine core.")

    def get(self, timeout: float | None = None) -> list[tuple]:
        """Messages from the core (waits up to timeout for the first; [] on timeout)."""
        try:
            return self._from_core.get(timeout)
        except EOFError:  # the core's side closed and everything it sent has been read
            raise CoreDeadError(self._death()) from None

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

    _to_core = property(lambda self: self.inbox)
    _from_core = property(lambda self: self.outbox)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise CoreDeadError(self._dead)

    def _death(self) -> str:
        return self._dead or "the engine core thread is gone."

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
        # The two threads that touch the pipe (pipe.py, as the core's): what is queued goes as one frame, up to
        # FRAME_BYTES; what the core writes is read as it comes.
        self._writer = PipeWriter(self.conn, SEND_QUEUE_BYTES, "tokenmill-core-sender", FRAME_BYTES,
                                  on_broken=self._pipe_broke)
        self._reader = PipeReader(self.conn, RECV_QUEUE_BYTES, "tokenmill-core-receiver",
                                  "reading from the engine core failed")
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

    # ---- what callers use (send, send_requests: CoreClient's) -------------------------------
    _to_core = property(lambda self: self._writer.outbox)
    _from_core = property(lambda self: self._reader.inbox)

    def _pipe_broke(self) -> None:  # (the writer thread, when the pipe breaks under it)
        self._dead = self._dead or self._death()

    def _check_alive(self) -> None:
        if self._dead is None and not self.proc.is_alive():
            self._dead = f"the engine core process died (exit code {self.proc.exitcode})."
        if self._dead is not None:
            raise CoreDeadError(self._dead)

    def get(self, timeout: float | None = None) -> list[tuple]:
        msgs = super().get(timeout)
        if not msgs and not self.proc.is_alive():
            self._reader.thread.join(0.5)  # it reads what the core said last, then sees the pipe close
            if self._reader.thread.is_alive():  # something else holds the pipe open: the core is gone all the same
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
        self._from_core.close()
        if self.proc.is_alive():
            try:
                self.send(("shutdown", None))
            except CoreDeadError:
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(2.0)
        self._writer.close(JOIN_TIMEOUT_S)
        self._reader.thread.join(JOIN_TIMEOUT_S)
        self.conn.close()


def make_core_client(config: EngineConfig, own_process: bool) -> CoreClient:
    return ProcessCoreClient(config) if own_process else ThreadCoreClient(config)
