"""Timing a step's forward without a device sync (issue 31).

The runner reports how long each forward took (StepTimings.forward_s: the adaptive speculation policy and
/v1/diagnostics live on it). On the CPU that is the wall clock around the call. On CUDA the call returns as soon as
the kernels are queued, so the wall clock would need `torch.cuda.synchronize()` after it, a stall in every step;
instead two CUDA events are recorded on the stream around the forward and read once the step's results have
been copied to the host, which has waited for the stream anyway.
"""
from __future__ import annotations

import time

import torch


class ForwardClock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.t0 = self.t1 = 0.0
        self._events = None

    def start(self) -> None:
        self.t0 = time.perf_counter()
        if self.cuda:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()

    def stop(self) -> None:
        """The forward is queued (CUDA) or done (CPU); t1 is the wall clock now."""
        if self.cuda:
            self._events[1].record()
        self.t1 = time.perf_counter()

    def seconds(self) -> float:
        """The forward's duration: call after the step's results reached the host (on CUDA the end event is then
        complete, so waiting for it costs nothing)."""
        if not self.cuda:
            return self.t1 - self.t0
        start, end = self._events
        end.synchronize()
        return start.elapsed_time(end) / 1000.0
