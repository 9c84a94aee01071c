"""What every benchmark that starts servers shares: `--port` (the first server's port; each further server takes
the next one), and Ctrl-C (SIGINT) or SIGTERM stopping the script and every process it started within 10 s.

The handler does not leave the servers to the script's `finally` blocks: those would drain each server in turn
(up to --drain-timeout each). It asks every child to stop (SIGTERM: a tokenmill server drains what it can),
kills what is left after GRACE_S, the children's own children (engine cores, workers) included, and then raises
KeyboardInterrupt so the script unwinds (temporary folders removed); if that has not ended it within UNWIND_S
(a client thread blocked on a request the process would wait for), the process exits with 128 + the signal.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

GRACE_S = 3.0  # SIGTERM to SIGKILL: a drain with nothing in flight takes about a second
UNWIND_S = 3.0
_next_port: int | None = None
_lock = threading.Lock()


def add_port_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=None,
                        help="port of the first server this script starts, the next one +1, ... (default: free ports)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def next_port() -> int:
    """The next server's port: from --port on, else a free one."""
    global _next_port
    with _lock:  # servers may start from several threads
        if _next_port is None:
            return free_port()
        port, _next_port = _next_port, _next_port + 1
        return port


def children(pid: int) -> list[int]:
    """The direct children of `pid` (Linux /proc; none once it is gone)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    kids = []
    for task in tasks:
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, parents before their children."""
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop(0))
        found += kids
        todo += kids
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; its parent (us) is about to go


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def stop_children(grace_s: float = GRACE_S) -> None:
    """SIGTERM every child of this process, SIGKILL whatever is left below it after `grace_s`."""
    everyone = descendants(os.getpid())
    _signal(children(os.getpid()), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(_alive(p) for p in everyone) and time.monotonic() < deadline:
        time.sleep(0.05)
    # the ones that were below a child that exited were reparented: kill by the pids seen before, and anything new
    _signal([p for p in everyone + descendants(os.getpid()) if _alive(p)], signal.SIGKILL)


def _on_signal(signum: int, frame) -> None:
    signal.signal(signum, signal.SIG_DFL)  # a second Ctrl-C ends the script at once
    print(f"\n{signal.Signals(signum).name}: stopping this benchmark and its servers", file=sys.stderr, flush=True)
    stop_children()

    def leave() -> None:
        time.sleep(UNWIND_S)
        sys.stdout.flush()
        os._exit(128 + signum)

    threading.Thread(target=leave, daemon=True).start()
    raise KeyboardInterrupt


def install(port: int | None) -> None:
    """Call first thing in main(): `port` is --port's value."""
    global _next_port
    _next_port = port
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
