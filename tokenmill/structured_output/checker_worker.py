"""The grammar checker process (run by isolation.py as `python checker_worker.py`): a JSON line with a grammar in,
a JSON line with llguidance's verdict out, each check on a thread with the 8 MiB stack the limits were measured
on, in a bounded address space. Exits when its input closes (the parent is gone).

It imports only the standard library, llguidance and threads.py (loaded by its path, which is standard library
only): never the tokenmill package, whose imports a worker would pay for at every start.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys

WORKER_MEMORY_BYTES = 4 << 30  # the worker's address space: a grammar that needs more kills only it


def _threads_module():
    """threads.py, beside this file, loaded by its path (importing tokenmill.structured_output.threads would import
    the tokenmill package first)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "threads.py")
    spec = importlib.util.spec_from_file_location("_tokenmill_checker_threads", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    """The checker process's loop; exits when its input closes (the parent is gone)."""
    import resource
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the server; it closes our input
    try:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = WORKER_MEMORY_BYTES if hard == resource.RLIM_INFINITY else min(hard, WORKER_MEMORY_BYTES)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ValueError, OSError):
        pass
    import llguidance

    threads = _threads_module()
    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        grammar = json.loads(line)["grammar"]
        result: dict[str, str] = {}

        def run() -> None:
            try:
                result["error"] = llguidance.LLMatcher.validate_grammar(grammar)
            except Exception as e:
                result["error"] = f"{type(e).__name__}: {e}"

        threads.start_thread(run, "check", threads.CHECK_STACK_BYTES).join()
        out.write(json.dumps({"error": result.get("error", "the check failed")[:4000]}).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder holds grammar.py and manager.py: no module of ours shadows another
    main()
