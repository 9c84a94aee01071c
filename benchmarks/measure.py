"""Measurement helpers shared by the benchmark scripts: the load line printed with every figure, the
CPU other processes took during a run (from /proc/stat) and the machine's streaming read bandwidth."""
from __future__ import annotations

import os
import time

import torch


def env() -> dict:
    return {"loadavg": [round(x, 2) for x in os.getloadavg()], "threads": torch.get_num_threads()}


def env_str(e: dict | None = None) -> str:
    e = e or env()
    return f"[load {'/'.join(f'{x:.2f}' for x in e['loadavg'])}, threads {e['threads']}]"


class OtherLoad:
    """CPU time other processes used since `mark()`, in cores: (machine busy time - this process's) / wall.
    From /proc/stat, so it counts what the load average blurs over a minute; None where unavailable."""

    HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __init__(self) -> None:
        self.mark()

    @classmethod
    def _busy(cls) -> float | None:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
        guest = sum(v[8:10])  # already counted in user/nice
        return (sum(v) - idle - guest) / cls.HZ

    def mark(self) -> None:
        t = os.times()
        self.t, self.own, self.busy = time.perf_counter(), t.user + t.system, self._busy()

    def cores(self) -> float | None:
        busy = self._busy()
        if busy is None or self.busy is None:
            return None
        t = os.times()
        wall = time.perf_counter() - self.t
        return max(0.0, (busy - self.busy) - (t.user + t.system - self.own)) / wall if wall > 0 else None


def warn_if_busy(cores: float | None, when: str) -> str:
    """Other processes' CPU use during a measurement, with a warning when it competes for the cores."""
    if cores is None:
        return ""
    msg = f"other processes used {cores:.2f} cores {when}"
    if cores > 0.2 and cores + torch.get_num_threads() > (os.cpu_count() or 1):
        msg = ("WARNING: " + msg + f" with {torch.get_num_threads()} threads on {os.cpu_count()} cores: "
               "multi-threaded timings are inflated (watch for 4 ms steps)")
    return msg


def measure_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s for streaming reads of a large fp32 tensor (what a weight-bound decode does)."""
    x = torch.ones(nbytes // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best
