"""How many threads the weight-streaming kernels use, chosen by measuring steps (issue 45: contention).

A batch-1 decode splits each GEMV over every core. When another process keeps one core busy, the thread on that
core runs only when the OS gives it a slice, and every parallel region waits for it at the join: measured on a
2-vCPU Xeon with a busy process pinned to one core, a 1.7B Q4_0 decode ran at 2.4-2.9 tok/s on two threads and
10.3 on one (19.6 quiet on two; docs/performance.md). Nothing outside the process says reliably that this is
happening (load counts our own threads; steal time is zero on a shared host), so the governor measures: it times
the forward of steps of the same size, now and then runs one step ("a probe") with the other thread count, and
keeps whichever is faster by a clear margin. Probes back off (doubling their interval up to MAX_PROBE_EVERY)
while they confirm the choice: a quiet machine pays about one slower step in 256, and a machine whose neighbour
has gone gets its threads back within 256 steps.

It sets torch's thread count for decode-sized steps (up to MAX_TOKENS tokens) and gives prompt steps every
thread back. It acts on models whose GEMVs are tokenmill's GGUF kernels, where each output row is computed by one
thread with the same code whatever the count; the native attention plans its decode partitions for the full
count (`set_attention_plan_threads`), so no step's result depends on the choice. (Float models' GEMVs run in
oneDNN/MKL, whose sums may follow the thread count: those are left alone.) TOKENMILL_THREAD_GOVERNOR=0 turns it
off.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger(__name__)

PROBE_EVERY = 16  # steps of one size between probes, at first and after a switch
MAX_PROBE_EVERY = 256
MARGIN = 0.85  # a probe must take under this share of the current count's time to switch
ALPHA = 0.25  # weight of a new step in the running mean of a (size, threads) pair
MAX_TOKENS = 8  # steps of more tokens run the prompt GEMMs, which take torch's threads: not governed


@dataclass
class ThreadGovernor:
    """Per step: `begin(tokens)` before the forward (sets the thread count through `apply`), `end(seconds)`
    after it."""

    max_threads: int
    apply: Callable[[int], object]
    threads: int = 0  # the current choice (0 until the first step: max_threads)
    mean: dict[tuple[int, int], float] = field(default_factory=dict)  # (tokens, threads) -> seconds
    every: int = 0  # steps between probes (0 until the first step: PROBE_EVERY)
    since_probe: int = 0
    switches: int = 0
    _step: tuple[int, int, bool] | None = None  # (tokens, threads, probing) of the step in flight
    _applied: int = 0

    def __post_init__(self) -> None:
        self.threads = self.threads or self.max_threads
        self.every = self.every or PROBE_EVERY

    def other(self) -> int:
        return 1 if self.threads == self.max_threads else self.max_threads

    def begin(self, tokens: int) -> None:
        self._step = None
        if self.max_threads <= 1:
            return
        if tokens > MAX_TOKENS:
            self._set(self.max_threads)  # prompt steps: every thread
            return
        self.since_probe += 1
        probing = self.since_probe >= self.every and (tokens, self.threads) in self.mean
        n = self.other() if probing else self.threads
        if probing:
            self.since_probe = 0
        self._set(n)
        self._step = (tokens, n, probing)

    def close(self) -> None:
        """The engine stops: every thread back (an engine in the caller's process shares its thread count)."""
        self._set(self.max_threads)

    def _set(self, n: int) -> None:
        if n != self._applied:
            self.apply(n)
            self._applied = n

    def end(self, seconds: float) -> None:
        if self._step is None:
            return
        tokens, n, probing = self._step
        self._step = None
        if probing and seconds < MARGIN * self.mean[(tokens, self.threads)]:
            log.info("thread governor: %d thread(s) ran a %d-token step in %.1f ms against %.1f ms with %d: "
                     "switching (another process is using a core, or it stopped)", n, tokens, seconds * 1e3,
                     self.mean[(tokens, self.threads)] * 1e3, self.threads)
            self.threads, self.every, self.switches = n, PROBE_EVERY, self.switches + 1
            self.mean[(tokens, n)] = seconds
        else:
            if probing:  # the choice stands: probe less often
                self.every = min(2 * self.every, MAX_PROBE_EVERY)
            old = self.mean.get((tokens, n))
            self.mean[(tokens, n)] = seconds if old is None else old + ALPHA * (seconds - old)
        self._set(self.threads)  # after a probe, back to the choice now: the caller's process keeps its threads


def make_governor(device_type: str, threads: int, model: object) -> ThreadGovernor | None:
    """A governor for a CPU runner with several threads whose model has GGUF kernel layers, unless turned off."""
    from tokenmill import native

    if device_type != "cpu" or threads <= 1 or os.environ.get("TOKENMILL_THREAD_GOVERNOR", "1") == "0" \
            or not native.has_op("set_attention_plan_threads") or not has_gguf_kernels(model):
        return None
    import torch

    torch.ops.tokenmill.set_attention_plan_threads(threads)
    return ThreadGovernor(threads, torch.set_num_threads)


def has_gguf_kernels(model: object) -> bool:
    import torch

    from tokenmill.layers.quantization.gguf import GGUFLinearMethod

    return isinstance(model, torch.nn.Module) and any(
        isinstance(m.quant_method, GGUFLinearMethod) for m in model.modules() if hasattr(m, "quant_method"))
