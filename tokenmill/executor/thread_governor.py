"""How many threads a step runs on, chosen by measuring steps (issue 45: contention).

A step splits each GEMV and GEMM over every core. When another process keeps one core busy, the thread on that
core runs only when the OS gives it a slice, and every parallel region waits for it at the join: measured on a
2-vCPU Xeon with a busy process pinned to one core, a 1.7B Q4_0 decode ran at 2.4-2.9 tok/s on two threads and
10.3 on one (19.6 quiet on two), and SmolLM2-135M offline (16 requests) at 31 tok/s in bfloat16 on two threads
against 170 on one, 17 against 71 in float32 (docs/performance.md). So the governor times the forward of steps
of each size (per token), now and then runs one step ("a probe") with the other thread count, and keeps
whichever is faster by a clear margin, per step size (a size seen for the first time starts where the last switch
went, and probes at its second step). Probes back off (doubling their interval up to
MAX_PROBE_EVERY) while they confirm the choice; a size whose neighbour has gone gets its threads back within
MAX_PROBE_EVERY of its steps.

When a probe may run depends on whether the count can change a result:
- Decode-sized steps (up to MAX_TOKENS tokens) of a model whose GEMVs are tokenmill's GGUF kernels: each output
  row is computed by one thread with the same code whatever the count, and the native attention plans its decode
  partitions for the full count (`set_attention_plan_threads`), so no result depends on the choice: probes run
  at any time (a quiet machine pays about one slower step in MAX_PROBE_EVERY).
- Every other step (float models, whose oneDNN/MKL GEMMs may split a sum over threads; prompt-sized steps):
  the last bits of a result can follow the count, so on a quiet machine nothing changes; probes run only while
  the stepping thread waits for a CPU (executor/run_queue.py: a neighbour is likely) or while the size already
  runs on fewer threads than the machine has.
TOKENMILL_THREAD_GOVERNOR=0 turns it off.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger(__name__)

PROBE_EVERY = 16  # steps of one size between probes, at first and after a switch
MAX_PROBE_EVERY = 256
MARGIN = 0.85  # a probe must take under this share of the current count's time (per token) to switch
ALPHA = 0.25  # weight of a new step in the running mean of a (size, threads) pair
MAX_TOKENS = 8  # decode-sized steps: the GGUF row loops, whose results do not depend on the count


def size_key(tokens: int) -> int:
    """Steps are grouped by size: exact up to MAX_TOKENS, then by the next power of two (times per token)."""
    return tokens if tokens <= MAX_TOKENS else 1 << (tokens - 1).bit_length()


@dataclass
class SizeState:
    """One step size's choice and the measurements behind it."""

    threads: int
    every: int  # steps between probes
    since_probe: int = 0
    mean: dict[int, float] = field(default_factory=dict)  # threads -> seconds per token (running mean)


@dataclass
class ThreadGovernor:
    """Per step: `begin(tokens)` before the forward (sets the thread count through `apply`), `end(seconds)`
    after it. `invariant`: decode-sized steps give the same results on any count (GGUF kernels);
    `contended`: whether a neighbour is suspected now (run_queue.RunQueueWait.contended)."""

    max_threads: int
    apply: Callable[[int], object]
    invariant: bool = True
    contended: Callable[[], bool] = lambda: False
    sizes: dict[int, SizeState] = field(default_factory=dict)
    switches: int = 0
    hint: int = 0  # the count the last switch chose (0 until one: max_threads)
    _step: tuple[int, int, int, bool] | None = None  # (key, tokens, threads, probing) of the step in flight
    _applied: int = 0

    def state(self, tokens: int) -> SizeState:
        key = size_key(tokens)
        if key not in self.sizes:
            # A new size starts where the last switch went (a neighbour slows every size alike) and probes at
            # its second step (its first gives the mean a probe is measured against).
            self.sizes[key] = SizeState(self.hint or self.max_threads, PROBE_EVERY, since_probe=PROBE_EVERY)
        return self.sizes[key]

    def other(self, n: int) -> int:
        return 1 if n == self.max_threads else self.max_threads

    def begin(self, tokens: int) -> None:
        self._step = None
        if self.max_threads <= 1 or tokens <= 0:
            return
        s = self.state(tokens)
        free = self.invariant and tokens <= MAX_TOKENS
        may_probe = free or s.threads != self.max_threads or self.contended()
        probing = False
        if may_probe:
            s.since_probe += 1
            probing = s.since_probe >= s.every and s.threads in s.mean
            if probing:
                s.since_probe = 0
        n = self.other(s.threads) if probing else s.threads
        self._set(n)
        self._step = (size_key(tokens), tokens, n, probing)

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
        key, tokens, n, probing = self._step
        self._step = None
        s = self.sizes[key]
        per_token = seconds / tokens
        if probing and per_token < MARGIN * s.mean[s.threads]:
            log.info("thread governor: %d thread(s) ran a %d-token step in %.1f ms (%.2f ms a token against %.2f "
                     "with %d): switching steps of this size (another process is using a core, or it stopped)",
                     n, tokens, seconds * 1e3, per_token * 1e3, s.mean[s.threads] * 1e3, s.threads)
            s.threads, s.every = n, PROBE_EVERY
            s.mean[n] = per_token
            self.switches += 1
            self.hint = n
        else:
            if probing:  # the choice stands: probe less often
                s.every = min(2 * s.every, MAX_PROBE_EVERY)
            old = s.mean.get(n)
            s.mean[n] = per_token if old is None else old + ALPHA * (per_token - old)
        self._set(s.threads)  # after a probe, back to the choice now: the caller's process keeps its threads


def make_governor(device_type: str, threads: int, model: object) -> ThreadGovernor | None:
    """A governor for a CPU runner with several threads, unless turned off. Models without GGUF kernels need the
    run-queue signal (their probes wait for it)."""
    from tokenmill import native
    from tokenmill.executor.run_queue import RunQueueWait

    if device_type != "cpu" or threads <= 1 or os.environ.get("TOKENMILL_THREAD_GOVERNOR", "1") == "0" \
            or not native.has_op("set_attention_plan_threads"):
        return None
    import torch

    invariant = has_gguf_kernels(model)
    wait = RunQueueWait()
    if not invariant and not wait.available():
        return None
    torch.ops.tokenmill.set_attention_plan_threads(threads)
    return ThreadGovernor(threads, torch.set_num_threads, invariant=invariant, contended=wait.contended)


def has_gguf_kernels(model: object) -> bool:
    import torch

    from tokenmill.layers.quantization.gguf import GGUFLinearMethod

    return isinstance(model, torch.nn.Module) and any(
        isinstance(m.quant_method, GGUFLinearMethod) for m in model.modules() if hasattr(m, "quant_method"))
