"""How many drafts to propose next step: the k in 0..K that maximises expected tokens per second.

With per-token acceptance a, a request verifying k drafts emits E(k) = 1 + a + ... + a^k tokens. A step
with B decoding requests then costs t(B(k+1)) for the target forward over B(k+1) tokens plus the
drafting D(k), and yields B E(k) tokens. t(T) is measured, not assumed: every step's forward time is
recorded against its token count, so prefill steps show the compute-bound slope and decode steps the
bandwidth-bound floor. At batch 1 on a CPU t(4) ~ t(1) and speculation pays; at batch 64 t(256) ~ 4
t(64) and it cannot, so k falls to 0 (off) for that step. While off, one step in PROBE_EVERY drafts
anyway, so acceptance is measured again as the text changes. No torch.
"""
from __future__ import annotations

import bisect
import math

EWMA = 0.2  # weight of a new observation
PRIOR_ACCEPTANCE = 0.6  # before any verification
MIN_GAIN = 1.05  # speculate only when the model expects at least this much over plain decoding
PROBE_EVERY = 64  # after this many steps off, draft once anyway: acceptance and costs drift with the text


def expected_tokens(a: float, k: int) -> float:
    """1 + a + ... + a^k: tokens emitted per request verifying k drafts."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class ForwardCost:
    """t(T): seconds of a target forward over T tokens, from observed steps (EWMA per geometric bucket of T,
    piecewise linear in between, flat below the smallest seen, proportional to T above the largest)."""

    def __init__(self) -> None:
        self.keys: list[float] = []  # bucket centres (token counts), sorted
        self.secs: list[float] = []

    @staticmethod
    def _bucket(tokens: int) -> float:
        return 2 ** (round(2 * math.log2(max(tokens, 1))) / 2)

    def observe(self, tokens: int, seconds: float) -> None:
        key = self._bucket(tokens)
        i = bisect.bisect_left(self.keys, key)
        if i < len(self.keys) and self.keys[i] == key:
            self.secs[i] += EWMA * (seconds - self.secs[i])
        else:
            self.keys.insert(i, key)
            self.secs.insert(i, seconds)

    def __call__(self, tokens: float) -> float | None:
        if not self.keys:
            return None
        keys, secs = self.keys, self.secs
        if tokens <= keys[0]:
            return secs[0]
        if tokens >= keys[-1]:
            return secs[-1] * tokens / keys[-1]
        i = bisect.bisect_left(keys, tokens)
        x0, x1, y0, y1 = keys[i - 1], keys[i], secs[i - 1], secs[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)


class AdaptivePolicy:
    def __init__(self, max_k: int, adaptive: bool = True, disable_by_batch_size: int | None = None) -> None:
        self.max_k = max_k
        self.adaptive = adaptive
        self.disable_by_batch_size = disable_by_batch_size
        self.forward = ForwardCost()
        self.accepted = PRIOR_ACCEPTANCE * 4  # decayed counts behind the acceptance estimate
        self.trials = 4.0
        self.draft_s: dict[int, float] = {}  # batch size bucket -> seconds per drafted position (all requests)
        self.last_k = max_k
        self.off_steps = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.trials if self.trials else PRIOR_ACCEPTANCE

    def observe_verification(self, drafted: int, accepted: int) -> None:
        """One request's verification: `accepted` of `drafted` drafts kept (stopped at the first rejection).
        Acceptance is the geometric model's estimate: accepted / (accepted + rejections)."""
        if drafted <= 0:
            return
        self.accepted = self.accepted * 0.995 + accepted
        self.trials = self.trials * 0.995 + accepted + (1 if accepted < drafted else 0)

    def observe_draft(self, batch: int, k: int, seconds: float) -> None:
        if k <= 0 or batch <= 0:
            return
        key = 1 << (batch - 1).bit_length()
        per = seconds / k
        old = self.draft_s.get(key)
        self.draft_s[key] = per if old is None else old + EWMA * (per - old)

    def _draft_cost(self, batch: int, k: int) -> float:
        if not self.draft_s:
            return 0.0
        key = 1 << (batch - 1).bit_length()
        per = self.draft_s.get(key)
        if per is None:  # the nearest measured batch size, scaled
            near = min(self.draft_s, key=lambda b: abs(math.log2(b / key)))
            per = self.draft_s[near] * max(1.0, key / near)
        return per * k

    def choose(self, batch: int) -> int:
        """k for the next step with `batch` requests decoding (0: no drafts)."""
        if batch <= 0:
            return 0
        if self.disable_by_batch_size is not None and batch >= self.disable_by_batch_size:
            self.last_k = 0
            return 0
        if not self.adaptive:
            self.last_k = self.max_k
            return self.max_k
        base = self.forward(batch)
        if base is None:
            self.last_k = self.max_k
            return self.max_k
        a = self.acceptance
        best_k, best = 0, batch / base
        for k in range(1, self.max_k + 1):
            cost = self.forward(batch * (k + 1)) + self._draft_cost(batch, k)
            rate = batch * expected_tokens(a, k) / cost
            if rate > best * (MIN_GAIN if best_k == 0 else 1.0):
                best_k, best = k, rate
        if best_k == 0:
            self.off_steps += 1
            if self.off_steps >= PROBE_EVERY:
                self.off_steps = 0
                best_k = self.max_k
        else:
            self.off_steps = 0
        self.last_k = best_k
        return best_k
