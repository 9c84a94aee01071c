"""Whether another process is taking our cores: how long the stepping thread waited for a CPU.

Linux keeps, per thread, the time it spent runnable but not running (`/proc/thread-self/schedstat`, second field,
nanoseconds; CONFIG_SCHED_INFO, on in every distribution kernel). The thread that runs the model's steps joins
every OpenMP region, so when a neighbour keeps one of our cores busy it waits in the run queue too. Its share of
the wall time between two readings, measured on a 2-vCPU Xeon VM with two torch threads running GEMVs:
0.005-0.02 quiet, 0.42-0.45 with a busy process pinned to one core (docs/performance.md, contention). Neither the
load average (it counts our own threads) nor steal time (zero on a shared host) says this.

The reading is a signal, not a verdict: the thread governor only uses it to decide whether to try another thread
count, and keeps whichever count measures faster.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

SCHEDSTAT = "/proc/thread-self/schedstat"
INTERVAL_S = 0.1  # read at most this often: one read costs ~0.2 ms
THRESHOLD = 0.15  # share of wall time spent waiting above which a neighbour is suspected


def run_delay_ns() -> int | None:
    """Nanoseconds the calling thread has waited runnable for a CPU since it started; None where not kept."""
    try:
        with open(SCHEDSTAT) as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class RunQueueWait:
    """`contended()`: whether the calling thread waited for a CPU for more than `threshold` of the wall time over
    the last reading's interval (read at most every `interval_s`; in between the last answer stands)."""

    read: Callable[[], int | None] = run_delay_ns
    clock: Callable[[], float] = time.monotonic
    interval_s: float = INTERVAL_S
    threshold: float = THRESHOLD
    share: float = 0.0  # the last interval's waiting share
    _last: tuple[float, int] | None = field(default=None, repr=False)

    def available(self) -> bool:
        return self.read() is not None

    def contended(self) -> bool:
        now = self.clock()
        if self._last is not None and now - self._last[0] < self.interval_s:
            return self.share > self.threshold
        waited = self.read()
        if waited is None:
            return False
        if self._last is not None:
            self.share = (waited - self._last[1]) / 1e9 / max(now - self._last[0], 1e-9)
        self._last = (now, waited)
        return self.share > self.threshold
