"""Timing a step's forward without a device sync (issue 31, executor/forward_clock.py): on CUDA two events around
the forward, read after the results' copy; torch.cuda.synchronize is never called. Here with torch.cuda's events
stood in for."""
from __future__ import annotations

import torch

from tokenmill.executor.forward_clock import ForwardClock


def test_cuda_forward_time_comes_from_events_without_a_device_sync(monkeypatch):
    recorded = []

    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.at = None

        def record(self) -> None:
            self.at = len(recorded)
            recorded.append(self)

        def synchronize(self) -> None:
            assert self.at is not None

        def elapsed_time(self, end: "FakeEvent") -> float:
            return 12.5 * (end.at - self.at)  # milliseconds, as CUDA events report

    def no_sync(*a, **k):
        raise AssertionError("the forward clock must not synchronise the device")

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    clock = ForwardClock(torch.device("cuda"))
    clock.start()
    clock.stop()
    assert len(recorded) == 2 and clock.seconds() == 0.0125


def test_cpu_forward_time_is_the_wall_clock():
    clock = ForwardClock(torch.device("cpu"))
    clock.start()
    sum(range(10000))
    clock.stop()
    assert clock.seconds() == clock.t1 - clock.t0 > 0
