"""The engine core's busy loop: take commands, step while there is work, send outputs.

The same loop runs in a thread of the server (`--no-engine-core-process`) or in a process of its own
(the default under `serve`; see core_client.py). Messages are plain tuples of picklable objects:

  to the core:   ("add", EngineCoreRequest) | ("abort", (ids, status, stop_reason))
                 | ("utility", (call_id, method, args)) | ("shutdown", None)
  from the core: ("ready", ModelFacts-ish info) | ("outputs", EngineCoreOutputs)
                 | ("stats", (SchedulerStats, adds taken)) | ("utility", (call_id, ok, result)) | ("step_failed", (message, request ids)) | ("dead", message)

Over a pipe, a frame is one pickled list of messages (pipe.py, shared with the clients): the n copies of a
request travel in one frame, so pickle writes their shared prompt ids once.

In a process of its own the core never blocks on the pipe, in either direction (issue 24): an input thread
reads frames as they come into the loop's inbox, so requests arrive while it steps; an output thread writes
the frames the loop queues, so a slow reader never stalls a step. If the reader falls behind by more than
OUTBOX_BYTES the loop stops stepping (and keeps taking commands) until the writer catches up: a bounded
queue, back-pressure, never a hang.
"""
from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import Any, Callable

from tokenmill.core.outputs import EngineCoreOutputs
from tokenmill.core.request import RequestStatus
from tokenmill.engine.pipe import (JOIN_TIMEOUT_S, Inbox, PipeReader, PipeWriter, QueueInbox,  # noqa: F401
                                   dump_frame, load_frame)  # (JOIN_TIMEOUT_S, QueueInbox, load_frame re-exported)

log = logging.getLogger(__name__)

# While requests are unfinished but nothing could be scheduled, wait this long for a command instead of spinning.
STALL_WAIT_S = 0.005
# Frames written ahead of a slow reader before the loop stops stepping (memory, not a stall).
OUTBOX_BYTES = 256 << 20
# Commands read ahead of the loop before the input thread stops reading (the pipe, then the client's
# send queue, then its callers see the back-pressure).
INBOX_BYTES = 256 << 20


def output_size(msg: tuple) -> int:
    """Roughly what a message from the core holds, in bytes, without pickling it (the in-process core's outbox
    is bounded by this, as a pipe's is by its frames): token ids, logprob rows, prompt logprob rows. O(outputs)."""
    kind, payload = msg
    if kind != "outputs":
        return 256
    size = 256
    for o in payload.outputs:
        size += 128 + 8 * len(o.new_token_ids)
        for lp in o.new_logprobs or ():
            size += 32 + 16 * len(lp[2])
        p = o.prompt_logprobs
        if p is not None:
            size += 24 * len(p.token_ids) + 16 * sum(len(ids) for ids in p.top_ids)
    return size


def run_core_loop(core, inbox: Inbox, send: Callable[[tuple], None],
                  can_step: Callable[[], bool] = lambda: True) -> None:
    """Until ("shutdown") or the sender goes away. A failing step aborts what was in flight, reports it,
    and the loop carries on: one bad step does not take the server down. While `can_step()` is False (the
    outputs' reader is far behind) the loop takes commands but does not step."""
    stalled = False
    added = 0
    told = None  # (waiting, added) last reported ahead of a step

    def on_scheduled(stats) -> None:
        nonlocal told
        if (stats.num_waiting, added) != told:
            told = (stats.num_waiting, added)
            send(("stats", (stats, added)))

    while True:
        held = not can_step()
        busy = core.has_unfinished_requests() and not held
        t0 = time.perf_counter()
        try:
            msgs = inbox.get(STALL_WAIT_S if stalled or held else (0 if busy else None))
        except (EOFError, OSError):
            return
        if not busy:
            core.stats.idle_s += time.perf_counter() - t0  # for "where the time goes"
        for kind, payload in msgs:
            if kind == "shutdown":
                return
            added += kind == "add"
            _apply(core, kind, payload, send)
        stalled = False
        if msgs and not core.has_unfinished_requests():
            # Aborts freed blocks and no step follows: tell the client so its gauges do not go stale.
            send(("outputs", EngineCoreOutputs([], None, core.scheduler_stats(), core.stats.idle_s, added)))
        if core.has_unfinished_requests() and can_step():
            try:
                out: EngineCoreOutputs = core.step(on_scheduled)
            except Exception as e:
                log.exception("engine step failed; aborting %d request(s)", len(core.scheduler.requests))
                ids = list(core.scheduler.requests)
                core.abort_requests(ids)
                send(("step_failed", (f"internal engine error: {e}", ids)))
                from tokenmill.executor.executor import WorkerDiedError

                if isinstance(e, WorkerDiedError):  # no step can run again: the core dies, the server turns unhealthy
                    raise
                continue
            out.num_added = added
            send(("outputs", out))
            stalled = out.step is None


def _apply(core, kind: str, payload: Any, send) -> None:
    if kind == "add":
        try:
            core.add_request(payload)
        except Exception as e:  # e.g. a duplicate id: fail that request only
            send(("step_failed", (str(e), [payload.request_id])))
    elif kind == "abort":
        ids, status, stop_reason = payload
        core.abort_requests(ids, RequestStatus(status), stop_reason)
    elif kind == "utility":
        call_id, method, args = payload
        try:
            send(("utility", (call_id, True, getattr(core, method)(*args))))  # RPC: an EngineCore method
        except Exception as e:
            send(("utility", (call_id, False, f"{type(e).__name__}: {e}")))


class ParentGone(BaseException):
    """Raised in the core's main thread when the server closes the pipe while the core is still starting."""


def watch_parent_while_starting(conn, started: threading.Event) -> None:
    """Until the core reports ready, nothing is sent to it: the pipe turning readable means the server
    closed its end (it was stopped, or gave up waiting). Interrupt the start-up then, so the core's exit
    cleans up (the disk KV tier's folder, workers) now rather than after a load that nobody waits for."""
    import _thread
    import signal

    def stop(signum, frame) -> None:
        if not started.is_set():
            raise ParentGone

    signal.signal(signal.SIGUSR1, stop)

    def watch() -> None:
        while not started.is_set():
            try:
                if conn.poll(0.2):
                    break
            except (EOFError, OSError):
                break
        if not started.is_set():
            _thread.interrupt_main(signal.SIGUSR1)

    threading.Thread(target=watch, name="tokenmill-core-startup-watch", daemon=True).start()


def core_process_main(config, conn) -> None:
    """Entry of the engine-core process: build the core, report ready, loop until told to stop or until
    the server process goes away (its end of the pipe closes).

    SIGINT and SIGTERM are ignored here, and by the worker processes the core starts (an ignored signal
    stays ignored in a child): Ctrl-C in a terminal, `systemctl stop` and `docker stop` signal the server's
    whole process group, and it is the server's to drain its requests, then stop the core with a
    "shutdown" message, which stops the workers and removes the disk KV tier's folder. A core whose server
    is gone sees its pipe close and exits the same clean way, while starting too."""
    import signal

    from tokenmill.platform import exit_without_teardown, tune_malloc

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tune_malloc()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s core %(name)s: %(message)s")
    started = threading.Event()
    try:
        _run_core_process(config, conn, started)
    except ParentGone:  # what was built is released by its finalizers as the process exits
        log.info("the server went away while the engine core was starting; exiting")
        return
    exit_without_teardown(0)  # the core and its workers are shut down: the server's join need not wait longer


def _run_core_process(config, conn, started: threading.Event) -> None:
    from tokenmill.engine.core import EngineCore

    watch_parent_while_starting(conn, started)
    try:
        core = EngineCore(config)
    except ParentGone:
        raise
    except BaseException as e:
        started.set()
        try:
            conn.send_bytes(dump_frame([("dead", (f"{type(e).__name__}: {e}", traceback.format_exc()))]))
        except OSError:  # the server is gone as well
            pass
        return
    started.set()  # from here on the pipe carries commands; its end is the input thread's to notice
    try:
        conn.send_bytes(dump_frame([("ready", core.info)]))
    except OSError:  # the server went away meanwhile
        core.shutdown()
        return
    reader = PipeReader(conn, INBOX_BYTES, "tokenmill-core-input", "engine core input thread failed")
    writer = PipeWriter(conn, OUTBOX_BYTES, "tokenmill-core-output")
    try:
        run_core_loop(core, reader.inbox, writer.send, lambda: not writer.backlog)
    except BaseException as e:  # a worker died: requests were failed; now the server must turn unhealthy
        writer.send(("dead", (f"{type(e).__name__}: {e}", traceback.format_exc())))
    finally:
        writer.close()  # what the loop said last (outputs, "dead") reaches the client before the pipe closes
        core.shutdown()
