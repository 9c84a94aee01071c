"""The engine core's busy loop: take commands, step while there is work, send outputs.

The same loop runs in a thread of the server (`--no-engine-core-process`) or in a process of its own
(the default under `serve`; see core_client.py). Messages are plain tuples of picklable objects:

  to the core:   ("add", EngineCoreRequest) | ("abort", (ids, status, stop_reason))
                 | ("utility", (call_id, method, args)) | ("shutdown", None)
  from the core: ("ready", ModelFacts-ish info) | ("outputs", EngineCoreOutputs)
                 | ("stats", (SchedulerStats, adds taken)) | ("utility", (call_id, ok, result)) | ("step_failed", (message, request ids)) | ("dead", message)
"""
from __future__ import annotations

import logging
import queue
import time
import traceback
from typing import Any, Callable

from tokenmill.core.outputs import EngineCoreOutputs
from tokenmill.core.request import RequestStatus

log = logging.getLogger(__name__)

# While requests are unfinished but nothing could be scheduled, wait this long for a command instead of spinning.
STALL_WAIT_S = 0.005


class Inbox:
    """Commands for the loop: `get(timeout)` returns all waiting ones (waiting up to timeout for the first;
    None: forever). Raises EOFError when the sender is gone."""

    def get(self, timeout: float | None) -> list:
        raise NotImplementedError


class QueueInbox(Inbox):
    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, msg) -> None:
        self.queue.put(msg)

    def get(self, timeout: float | None) -> list:
        try:
            msgs = [self.queue.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                msgs.append(self.queue.get_nowait())
            except queue.Empty:
                return msgs


class PipeInbox(Inbox):
    def __init__(self, conn) -> None:
        self.conn = conn

    def get(self, timeout: float | None) -> list:
        if not self.conn.poll(timeout):
            return []
        msgs = [self.conn.recv()]
        while self.conn.poll(0):
            msgs.append(self.conn.recv())
        return msgs


def run_core_loop(core, inbox: Inbox, send: Callable[[tuple], None]) -> None:
    """Until ("shutdown") or the sender goes away. A failing step aborts what was in flight, reports it,
    and the loop carries on: one bad step does not take the server down."""
    stalled = False
    added = 0
    told = None  # (waiting, added) last reported ahead of a step

    def on_scheduled(stats) -> None:
        nonlocal told
        if (stats.num_waiting, added) != told:
            told = (stats.num_waiting, added)
            send(("stats", (stats, added)))

    while True:
        busy = core.has_unfinished_requests()
        t0 = time.perf_counter()
        try:
            msgs = inbox.get(STALL_WAIT_S if stalled else (0 if busy else None))
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
        if core.has_unfinished_requests():
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
            send(("utility", (call_id, True, getattr(core, method)(*args))))
        except Exception as e:
            send(("utility", (call_id, False, f"{type(e).__name__}: {e}")))


def core_process_main(config, conn) -> None:
    """Entry of the engine-core process: build the core, report ready, loop until told to stop or until
    the server process goes away (its end of the pipe closes)."""
    import signal

    from tokenmill.engine.core import EngineCore

    from tokenmill.platform import tune_malloc

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle (it drains, then stops us)
    tune_malloc()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s core %(name)s: %(message)s")
    try:
        core = EngineCore(config)
    except BaseException as e:
        conn.send(("dead", (f"{type(e).__name__}: {e}", traceback.format_exc())))
        return
    conn.send(("ready", core.info))
    try:
        run_core_loop(core, PipeInbox(conn), conn.send)
    except (BrokenPipeError, EOFError, OSError):
        pass
    except BaseException as e:  # a worker died: requests were failed; now the server must turn unhealthy
        try:
            conn.send(("dead", (f"{type(e).__name__}: {e}", traceback.format_exc())))
        except (BrokenPipeError, OSError):
            pass
    finally:
        core.shutdown()
