"""How many drafts to propose next step: the k in 0..K that maximises expected tokens per second.

With per-token acceptance a, a request verifying k drafts emits E(k) = 1 + a + ... + a^k tokens. A step
with B decoding requests costs

    t(B(k+1))  the target forward over B(k+1) tokens
  + D(B, k)    the drafting: a model draft's catch-up forward over each request's newly accepted tokens
               (which also yields the first draft) and k-1 single-token passes over the B requests
  + o(B)       everything else in a step (scheduling, input preparation, sampling, output processing)

and yields B E(k) tokens. Every term is measured, never assumed: t(T) from every target step by its
token count, t_d(T) from every forward the draft runs (catch-ups and passes alike) by its token count, and
o from the period between steps minus the forward and drafting time. Each is the lower quartile of the
last 7 observations of a geometric bucket of token counts (or of batch sizes for o), so slow steps
(another process on the CPU, a first call at a new shape) do not decide anything, and the first forward
of each model (one-time setup: allocation, kernel selection, weight packing) is not recorded at all.

Draft costs are per forward, not per step divided by k: a step's drafting also carries the catch-up over
whatever the draft has not seen (the whole prompt on a request's first step, every token skipped while
speculation was off on the first step after), and charging that to the k drafts made the first step and
every later probe look like drafting cost many target steps, so speculation switched itself off at
batch 1 where it pays and never came back on. Those long catch-ups are recorded as what they are, forwards
over many tokens.

Before anything is measured the policy drafts K (optimistic). At batch 1 on a CPU with float32 weights
t(5) ~ t(1) and speculation pays; with compute-bound weights (GGUF blocks) t(5) ~ 2 t(1), and at batch 64
t(320) ~ 4-5 t(64), where it may not, and k falls to 0 (off). While off, one step drafts K anyway after
PROBE_FIRST steps, then after twice as many each time it stays off (up to PROBE_MAX), so acceptance and
costs are measured again as the text and the load change. While drafting, the plain step's t(B) is never
observed (it is taken as flat from the smallest token count seen, which favours drafting), so after
PLAIN_FIRST drafting steps one step runs without drafts to measure it, then after twice as many, up to
PLAIN_MAX (at most one step in 256 while speculation keeps winning). No torch.
"""
from __future__ import annotations

import bisect
import math
from collections import deque

WINDOW = 7  # observations per bucket; the estimate is their lower quartile
PRIOR_ACCEPTANCE = 0.8  # before any verification: optimistic, as the first steps draft K anyway
PRIOR_TRIALS = 2.0  # weight of the prior, in verified drafts
DECAY = 0.995  # per verification: acceptance follows the text
MIN_GAIN = 1.05  # speculate only when the model expects at least this much over plain decoding
PROBE_FIRST = 8  # steps off before the first probe (one step drafting K)
PROBE_MAX = 64  # the interval doubles while probes find speculation still loses, up to this
PLAIN_FIRST = 32  # drafting steps before one plain step measures t(B), which drafting never observes
PLAIN_MAX = 256  # that interval doubles while speculation keeps winning, up to this


def expected_tokens(a: float, k: int) -> float:
    """1 + a + ... + a^k: tokens emitted per request verifying k drafts."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class _Window:
    """The last WINDOW observations; value is their lower quartile (the second smallest of 7, the smallest
    of up to 4). Timing noise only ever adds time (another process on the CPU, an OpenMP barrier waiting
    for a descheduled thread, a first call at a new shape), so a low quantile estimates what a forward
    costs when it runs undisturbed, the same for target and draft; one implausibly fast reading does
    not set it on its own once there are five."""

    __slots__ = ("xs", "value")

    def __init__(self, x: float) -> None:
        self.xs = deque((x,), maxlen=WINDOW)
        self.value = x

    def add(self, x: float) -> None:
        self.xs.append(x)
        s = sorted(self.xs)
        self.value = s[(len(s) - 1) // 4]

    def __len__(self) -> int:
        return len(self.xs)


class ForwardCost:
    """t(T): seconds of a forward over T tokens, from observed forwards (lower quartile of the last WINDOW per
    geometric bucket of T, piecewise linear in between, flat below the smallest seen, proportional to T
    above the largest)."""

    def __init__(self) -> None:
        self.keys: list[float] = []  # bucket centres (token counts), sorted
        self.windows: list[_Window] = []

    @staticmethod
    def _bucket(tokens: float) -> float:
        return 2 ** (round(2 * math.log2(max(tokens, 1))) / 2)

    @property
    def secs(self) -> list[float]:
        return [w.value for w in self.windows]

    def observe(self, tokens: int, seconds: float) -> None:
        key = self._bucket(tokens)
        i = bisect.bisect_left(self.keys, key)
        if i < len(self.keys) and self.keys[i] == key:
            self.windows[i].add(seconds)
        else:
            self.keys.insert(i, key)
            self.windows.insert(i, _Window(seconds))

    def samples(self, tokens: float) -> int:
        """Observations in the bucket of `tokens` (0: its cost is interpolated or extrapolated)."""
        key = self._bucket(tokens)
        i = bisect.bisect_left(self.keys, key)
        return len(self.windows[i]) if i < len(self.keys) and self.keys[i] == key else 0

    def __call__(self, tokens: float) -> float | None:
        if not self.keys:
            return None
        keys, w = self.keys, self.windows
        if tokens <= keys[0]:
            return w[0].value
        if tokens >= keys[-1]:
            return w[-1].value * tokens / keys[-1]
        i = bisect.bisect_left(keys, tokens)
        x0, x1, y0, y1 = keys[i - 1], keys[i], w[i - 1].value, w[i].value
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)


class BatchCost:
    """Seconds per step by batch size (lower quartile of the last WINDOW per power-of-two bucket; an unseen batch
    size takes the nearest seen one, scaled up proportionally when it is larger)."""

    def __init__(self) -> None:
        self.windows: dict[int, _Window] = {}

    @staticmethod
    def _bucket(batch: int) -> int:
        return 1 << (max(batch, 1) - 1).bit_length()

    def observe(self, batch: int, seconds: float) -> None:
        key = self._bucket(batch)
        w = self.windows.get(key)
        if w is None:
            self.windows[key] = _Window(seconds)
        else:
            w.add(seconds)

    def __call__(self, batch: int) -> float | None:
        if not self.windows:
            return None
        key = self._bucket(batch)
        w = self.windows.get(key)
        if w is not None:
            return w.value
        near = min(self.windows, key=lambda b: abs(math.log2(b / key)))
        return self.windows[near].value * max(1.0, key / near)


class AdaptivePolicy:
    """drafter: "model" (draft_model, quantized_self: catches up only while drafting), "head" (EAGLE,
    EAGLE-3, MTP: catches up every step, drafting or not) or "lookup" (ngram, Medusa, block drafters: no
    forward of their own with KV, one call per step).

    shape: what k means. "chain": k drafts in a row, emitting 1 + a + ... + a^k (the geometric model, which
    one acceptance estimate extends to every k). "tree": k nodes of a draft tree, "block": blocks of at most k
    drafts cut by the drafter's own acceptance estimate; neither follows the geometric model (a tree's
    accepted path is at most its depth; a block sends fewer than k rows when its estimate says so), so the
    tokens accepted and the rows verified are learned per k (decayed means, shrunk towards the geometric
    model's figures by PRIOR_TRIALS verifications: an untried k looks as good as a chain of k, so it is tried
    and then known). tree_width: an EAGLE-2 tree's width (its drafting costs one head forward per level over
    width x level rows, spec_decode/eagle_tree.py); 1 otherwise."""

    def __init__(self, max_k: int, adaptive: bool = True, disable_by_batch_size: int | None = None,
                 drafter: str = "model", shape: str = "chain", tree_width: int = 1, tree_depth: int = 1) -> None:
        if shape not in ("chain", "tree", "block"):
            raise ValueError(f"draft shape must be chain, tree or block, got {shape!r}")
        self.max_k = max_k
        self.adaptive = adaptive
        self.disable_by_batch_size = disable_by_batch_size
        self.drafter = drafter
        self.shape = shape
        self.tree_width, self.tree_depth = tree_width, tree_depth
        self.by_k: dict[int, list[float]] = {}  # k -> decayed [accepted, drafted, verifications] (trees, blocks)
        self.forward = ForwardCost()  # the target: t(T)
        self.draft_forward = ForwardCost()  # the draft model or head: t_d(T)
        self.lookup = BatchCost()  # ngram: seconds of one step's lookups
        self.overhead = BatchCost()  # seconds of a step outside the target forward and the drafting
        self.accepted = PRIOR_ACCEPTANCE * PRIOR_TRIALS  # decayed counts behind the acceptance estimate
        self.trials = PRIOR_TRIALS
        self.last_k = max_k
        self.off_steps = 0
        self.probe_every = PROBE_FIRST
        self.on_steps = 0
        self.plain_every = PLAIN_FIRST

    @property
    def acceptance(self) -> float:
        return self.accepted / self.trials if self.trials else PRIOR_ACCEPTANCE

    # ---- observations ---------------------------------------------------------------------------
    def observe_verification(self, drafted: int, accepted: int) -> None:
        """One request's verification: `accepted` of `drafted` drafts kept (stopped at the first rejection).
        Acceptance is the geometric model's estimate: accepted / (accepted + rejections)."""
        if drafted <= 0:
            return
        self.accepted = self.accepted * DECAY + accepted
        self.trials = self.trials * DECAY + accepted + (1 if accepted < drafted else 0)
        if self.shape != "chain":  # by the k that drafted it (observed before the next choice)
            s = self.by_k.setdefault(self.last_k, [0.0, 0.0, 0.0])
            s[0], s[1], s[2] = s[0] * DECAY + accepted, s[1] * DECAY + drafted, s[2] * DECAY + 1.0

    def observe_draft_forward(self, tokens: int, seconds: float) -> None:
        """One forward of the draft over `tokens` tokens (a catch-up or a pass), with its logits and sampling."""
        if tokens > 0:
            self.draft_forward.observe(tokens, seconds)

    def observe_draft(self, batch: int, k: int, seconds: float) -> None:
        """k drafting passes over `batch` requests took `seconds` in all (each a forward over `batch` tokens)."""
        if k <= 0 or batch <= 0:
            return
        for _ in range(k):
            self.draft_forward.observe(batch, seconds / k)

    def observe_lookup(self, batch: int, seconds: float) -> None:
        if batch > 0:
            self.lookup.observe(batch, seconds)

    def observe_overhead(self, batch: int, seconds: float) -> None:
        if batch > 0:
            self.overhead.observe(batch, max(seconds, 0.0))

    # ---- the model --------------------------------------------------------------------------------
    def draft_cost(self, batch: int, k: int, a: float) -> float:
        """D(B, k): seconds of drafting k tokens for each of `batch` requests (k = 0: what the drafter costs
        while speculation is off). Unmeasured costs count as 0 (optimistic: drafting measures them)."""
        if self.drafter == "lookup":
            return (self.lookup(batch) or 0.0) if k > 0 else 0.0
        t = self.draft_forward
        if not t.keys:
            return 0.0
        if self.drafter == "head":  # catch-up over the positions the target verified, every step
            catch_up = t(batch * (self.per_request(k, a)[0] if k > 0 else 1.0))
            levels = min(self.tree_depth, 1 + (k - 1) // self.tree_width) if k > 0 else 0
            if self.tree_width > 1 and levels >= 2:  # one forward per level over every node fed so far
                return catch_up + sum(t(batch * self.tree_width * d) for d in range(1, levels))
            return catch_up + max(k - 1, 0) * t(batch)
        if k == 0:
            return 0.0
        # Catch-up over the tokens the draft has not fed: the bonus token, and the last draft when all were
        # accepted (the others' KV was written when they were fed).
        return t(batch * (1.0 + a ** k)) + (k - 1) * t(batch)

    def per_request(self, k: int, a: float) -> tuple[float, float]:
        """(tokens emitted, drafts verified) per request and step at k."""
        if self.shape == "chain" or k == 0:
            return expected_tokens(a, k), float(k)
        acc, drafted, n = self.by_k.get(k, (0.0, 0.0, 0.0))
        prior = PRIOR_TRIALS
        return (1.0 + (acc + prior * (expected_tokens(a, k) - 1.0)) / (n + prior),
                (drafted + prior * k) / (n + prior))

    def rate(self, batch: int, k: int, a: float | None = None) -> float | None:
        """Expected tokens per second with k drafts per request (None: the target's cost is unmeasured)."""
        a = self.acceptance if a is None else a
        emitted, rows = self.per_request(k, a)
        target = self.forward(batch * (rows + 1))
        if target is None:
            return None
        cost = target + self.draft_cost(batch, k, a) + (self.overhead(batch) or 0.0)
        return batch * emitted / cost if cost > 0 else math.inf

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
        base = self.rate(batch, 0)
        if base is None:  # nothing measured yet: draft, which measures
            best_k = self.max_k
        else:
            a = self.acceptance
            best_k, best = 0, base * MIN_GAIN
            for k in range(1, self.max_k + 1):
                rate = self.rate(batch, k, a)
                if rate > best:
                    best_k, best = k, rate
        if best_k == 0:
            self.on_steps, self.plain_every = 0, PLAIN_FIRST
            self.off_steps += 1
            if self.off_steps > self.probe_every:  # measure again: the text, the load and the batch change
                self.off_steps = 0
                self.probe_every = min(2 * self.probe_every, PROBE_MAX)
                best_k = self.max_k
        else:
            self.off_steps, self.probe_every = 0, PROBE_FIRST
            self.on_steps += 1
            if self.on_steps > self.plain_every:  # one step without drafts: t(B) as it is now
                self.on_steps = 0
                self.plain_every = min(2 * self.plain_every, PLAIN_MAX)
                best_k = 0
        self.last_k = best_k
        return best_k
