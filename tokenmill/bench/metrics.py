"""Pure functions from per-request records to the benchmark summary.

Definitions (docs/bench.md states them for users):
- percentiles: numpy's default linear interpolation between the closest ranks;
- TTFT over successful requests that produced text; TPOT per successful request with more than one
  output token, (e2el - ttft) / (output_tokens - 1); ITL: every gap between content chunks of
  successful requests, pooled; E2EL over successful requests;
- duration: first send to last finish (failed requests included); throughputs count successful
  requests' tokens over that duration;
- goodput: successful requests meeting every given SLO, per second of duration;
- cost: the machine's cost over the duration, attributed whole to each unit (see `cost`).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

if TYPE_CHECKING:
    from tokenmill.bench.client import RequestRecord

SLO_KEYS = ("ttft", "tpot", "e2el")
MAX_ERROR_EXAMPLES = 20


@dataclass
class Stats:
    """A distribution in milliseconds; every field but count is None when there are no values."""

    count: int = 0
    mean: float | None = None
    median: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    max: float | None = None
    min: float | None = None
    std: float | None = None


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) with linear interpolation (numpy's default)."""
    if len(values) == 0:
        raise ValueError("percentile of no values")
    return float(np.percentile(np.asarray(values, dtype=float), p, method="linear"))


def stats(values: Iterable[float], scale: float = 1000.0) -> Stats:
    """Distribution of `values` (seconds) in `scale` units (ms by default)."""
    arr = np.asarray(list(values), dtype=float) * scale
    if arr.size == 0:
        return Stats()
    p50, p90, p95, p99 = (float(x) for x in np.percentile(arr, [50, 90, 95, 99], method="linear"))
    return Stats(count=int(arr.size), mean=float(arr.mean()), median=p50, p90=p90, p95=p95, p99=p99,
                 max=float(arr.max()), min=float(arr.min()), std=float(arr.std()))


def tpot(e2el: float, ttft: float | None, output_tokens: int) -> float | None:
    """Time per output token after the first: (e2el - ttft) / (output_tokens - 1); None when
    there is no first token or only one."""
    if ttft is None or output_tokens <= 1:
        return None
    return (e2el - ttft) / (output_tokens - 1)


def record_tpot(rec: RequestRecord) -> float | None:
    return tpot(rec.e2el, rec.ttft, rec.output_tokens)


def duration(records: Sequence[RequestRecord]) -> float:
    if not records:
        return 0.0
    return max(r.end for r in records) - min(r.start for r in records)


def per_second(amount: float, seconds: float) -> float | None:
    return amount / seconds if seconds > 0 else None


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """["ttft:200", "tpot:50"] (or one "ttft:200 tpot:50" string) -> {"ttft": 200.0, "tpot": 50.0} in ms."""
    out: dict[str, float] = {}
    for item in " ".join(items or []).split():
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"invalid --goodput item {item!r}: use KEY:MS with KEY one of {', '.join(SLO_KEYS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"invalid --goodput value in {item!r}: not a number of milliseconds") from None
        if ms <= 0 or math.isnan(ms):
            raise ValueError(f"invalid --goodput value in {item!r}: must be positive")
        out[key] = ms
    return out


def meets_slos(rec: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """A successful request meeting every SLO. No TTFT (no text came) fails a TTFT SLO; a request
    with at most one output token has no decode and meets any TPOT SLO."""
    if not rec.success:
        return False
    if "ttft" in slos_ms and (rec.ttft is None or rec.ttft * 1000 > slos_ms["ttft"]):
        return False
    t = record_tpot(rec)
    if "tpot" in slos_ms and t is not None and t * 1000 > slos_ms["tpot"]:
        return False
    return not ("e2el" in slos_ms and rec.e2el * 1000 > slos_ms["e2el"])


@dataclass
class Goodput:
    slos_ms: dict[str, float]
    good_requests: int
    request_rate: float | None  # good requests per second
    fraction: float | None      # good / all measured requests


def goodput(records: Sequence[RequestRecord], slos_ms: dict[str, float], seconds: float) -> Goodput:
    good = sum(meets_slos(r, slos_ms) for r in records)
    return Goodput(slos_ms=dict(slos_ms), good_requests=good, request_rate=per_second(good, seconds),
                   fraction=good / len(records) if records else None)


@dataclass
class Cost:
    """USD. The machine's cost over the run is attributed whole to each unit: per 1M output tokens
    is what a million output tokens cost if the machine did nothing else (the way hosted APIs
    price), and likewise for input; the figures therefore do not add up."""

    cost_per_hour: float
    total_usd: float
    per_request_usd: float | None
    per_1m_input_tokens_usd: float | None
    per_1m_output_tokens_usd: float | None
    per_1m_total_tokens_usd: float | None


def cost(cost_per_hour: float, seconds: float, completed: int, input_tokens: int, output_tokens: int) -> Cost:
    total = cost_per_hour * seconds / 3600.0

    def per(n: int, unit: float = 1.0) -> float | None:
        return total / n * unit if n > 0 else None

    return Cost(cost_per_hour=cost_per_hour, total_usd=total, per_request_usd=per(completed),
                per_1m_input_tokens_usd=per(input_tokens, 1e6), per_1m_output_tokens_usd=per(output_tokens, 1e6),
                per_1m_total_tokens_usd=per(input_tokens + output_tokens, 1e6))


def concurrency_steps(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, int]]:
    """(time, requests in flight from then on) at every start and end; a request ending at the
    instant another starts does not overlap it."""
    intervals = list(intervals)
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    out, n = [], 0
    for t, d in events:  # (t, -1) sorts before (t, +1): ends first
        n += d
        out.append((t, n))
    return out


def peak_concurrency(intervals: Iterable[tuple[float, float]]) -> int:
    return max((n for _, n in concurrency_steps(list(intervals))), default=0)


def chunk_times(rec: RequestRecord) -> list[float]:
    """When each content chunk arrived, in seconds since the benchmark start."""
    if rec.ttft is None:
        return []
    first = rec.start + rec.ttft
    return [first] + list(first + np.cumsum(rec.itl))


def throughput_timeline(records: Sequence[RequestRecord], bin_s: float) -> tuple[list[float], list[float], list[float]]:
    """Bin starts, output tokens/s and completed requests/s per bin. A request's output tokens
    are spread evenly over its chunks (a chunk may carry several tokens)."""
    ok = [r for r in records if r.success]
    if not records or bin_s <= 0:
        return [], [], []
    span = duration(records)
    t_min = min(r.start for r in records)
    nbins = max(1, int(math.ceil(span / bin_s)))
    tokens = np.zeros(nbins)
    done = np.zeros(nbins)
    for r in ok:
        times = chunk_times(r)
        if times:
            idx = np.minimum(((np.asarray(times) - t_min) / bin_s).astype(int), nbins - 1)
            np.add.at(tokens, idx, r.output_tokens / len(times))
        done[min(int((r.end - t_min) / bin_s), nbins - 1)] += 1
    starts = [t_min + i * bin_s for i in range(nbins)]
    return starts, list(tokens / bin_s), list(done / bin_s)


@dataclass
class ErrorSummary:
    total: int = 0
    by_type: dict[str, int] = field(default_factory=dict)
    examples: list[dict] = field(default_factory=list)  # {"index", "type", "status", "message"}


def error_summary(records: Sequence[RequestRecord]) -> ErrorSummary:
    failed = [r for r in records if r.error is not None]
    by_type = Counter(r.error.key for r in failed)
    examples, seen = [], Counter()
    for r in failed:  # a few of each kind, so one flood does not hide the rest
        if seen[r.error.key] < 3 and len(examples) < MAX_ERROR_EXAMPLES:
            seen[r.error.key] += 1
            examples.append({"index": r.index, "type": r.error.type, "status": r.error.status,
                             "message": r.error.message})
    return ErrorSummary(total=len(failed), by_type=dict(by_type.most_common()), examples=examples)


@dataclass
class Summary:
    duration_s: float
    num_requests: int
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float | None
    input_throughput: float | None
    output_throughput: float | None
    total_token_throughput: float | None
    peak_concurrency: int
    mean_concurrency: float | None  # time-averaged requests in flight: sum of E2EL / duration
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2el_ms: Stats
    goodput: Goodput | None
    cost: Cost | None
    errors: ErrorSummary
    token_sources: dict[str, int]  # successful requests by where their output count came from
    # Successful requests with fewer content chunks than output tokens: the server packed several
    # tokens into a chunk (their ITL gaps span several tokens), or some tokens had no text (EOS).
    fewer_chunks_than_tokens: int
    cached_prompt_tokens: int | None  # sum of usage.prompt_tokens_details.cached_tokens, when sent


def summarize(records: Sequence[RequestRecord], slos_ms: dict[str, float] | None = None,
              cost_per_hour: float | None = None) -> Summary:
    ok = [r for r in records if r.success]
    secs = duration(records)
    n_in = sum(r.input_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    return Summary(
        duration_s=secs, num_requests=len(records), completed=len(ok), failed=len(records) - len(ok),
        total_input_tokens=n_in, total_output_tokens=n_out,
        request_throughput=per_second(len(ok), secs), input_throughput=per_second(n_in, secs),
        output_throughput=per_second(n_out, secs), total_token_throughput=per_second(n_in + n_out, secs),
        peak_concurrency=peak_concurrency((r.start, r.end) for r in records),
        mean_concurrency=per_second(sum(r.e2el for r in records), secs),
        ttft_ms=stats(r.ttft for r in ok if r.ttft is not None),
        tpot_ms=stats(t for t in map(record_tpot, ok) if t is not None),
        itl_ms=stats(g for r in ok for g in r.itl),
        e2el_ms=stats(r.e2el for r in ok),
        goodput=goodput(records, slos_ms, secs) if slos_ms else None,
        cost=cost(cost_per_hour, secs, len(ok), n_in, n_out) if cost_per_hour is not None else None,
        errors=error_summary(records),
        token_sources=dict(Counter(r.token_source for r in ok)),
        fewer_chunks_than_tokens=sum(1 for r in ok if r.chunks and r.output_tokens > r.chunks),
        cached_prompt_tokens=sum(cached) if cached else None,
    )
