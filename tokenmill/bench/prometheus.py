"""The server's Prometheus `/metrics`, scraped before and after a run: what changed in between.

tokenmill exposes vLLM's metric names under `tokenmill:`; vLLM's own `vllm:` names are read the
same way. A metric the server does not expose comes out as None, never as an error.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

PREFIXES = ("tokenmill", "vllm")


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


def _parse_labels(text: str, i: int) -> tuple[tuple[tuple[str, str], ...], int]:
    """Labels from `text[i] == "{"`; returns them and the index after "}"."""
    labels, i = [], i + 1
    while True:
        while i < len(text) and text[i] in " ,":
            i += 1
        if i >= len(text):
            raise ValueError("unterminated labels")
        if text[i] == "}":
            return tuple(labels), i + 1
        eq = text.index("=", i)
        key = text[i:eq].strip()
        i = text.index('"', eq) + 1
        value = []
        while text[i] != '"':
            if text[i] == "\\" and i + 1 < len(text):
                value.append({"n": "\n", "\\": "\\", '"': '"'}.get(text[i + 1], text[i + 1]))
                i += 2
            else:
                value.append(text[i])
                i += 1
        labels.append((key, "".join(value)))
        i += 1


def parse_prometheus_text(text: str) -> list[Sample]:
    """Samples of the text exposition format; malformed lines are skipped."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            brace = line.find("{")
            space = line.find(" ")
            if brace != -1 and (space == -1 or brace < space):
                name = line[:brace]
                labels, i = _parse_labels(line, brace)
                rest = line[i:].split()
            else:
                name, *rest = line.split()
                labels = ()
            out.append(Sample(name, labels, float(rest[0])))  # float() reads +Inf, -Inf, NaN
        except (ValueError, IndexError):
            continue
    return out


def total(samples: Iterable[Sample], name: str) -> float | None:
    """Sum of `name` over all its label sets; None when absent."""
    values = [s.value for s in samples if s.name == name]
    return sum(values) if values else None


def buckets(samples: Iterable[Sample], name: str) -> dict[float, float]:
    """Cumulative bucket counts of histogram `name`, summed over other labels: {le: count}."""
    out: dict[float, float] = {}
    for s in samples:
        if s.name == name + "_bucket":
            le = dict(s.labels).get("le")
            if le is not None:
                out[float(le)] = out.get(float(le), 0.0) + s.value
    return out


def histogram_quantile(q: float, cumulative: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket holding the rank;
    a rank in the +Inf bucket gives the largest finite bound."""
    les = sorted(cumulative)
    if not les or not math.isinf(les[-1]) or cumulative[les[-1]] <= 0:
        return None
    rank = q * cumulative[les[-1]]
    prev_le, prev_count = 0.0, 0.0
    for le in les:
        count = cumulative[le]
        if count >= rank:
            if math.isinf(le):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return None


@dataclass
class ServerStats:
    """Changes in the server's counters over the run; None where the server does not expose one."""

    metrics_url: str
    scraped: bool = False          # both scrapes succeeded
    metric_prefix: str | None = None  # "tokenmill" or "vllm"
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    prefix_cache_hit_rate: float | None = None
    preemptions: float | None = None
    # Speculative decoding (vLLM's spec_decode_* counters): accepted / draft tokens, 1 + accepted / drafts.
    spec_draft_tokens: float | None = None
    spec_acceptance_rate: float | None = None
    spec_mean_acceptance_length: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    # Medians of the server's own histograms over the run, by Prometheus' interpolation rule.
    ttft_median_s: float | None = None
    e2el_median_s: float | None = None


def _delta(before: list[Sample], after: list[Sample], name: str) -> float | None:
    a, b = total(after, name), total(before, name)
    if a is None:
        return None
    d = a - (b or 0.0)
    return d if d >= 0 else None  # negative: the server restarted in between


def _median_delta(before: list[Sample], after: list[Sample], name: str) -> float | None:
    b0, b1 = buckets(before, name), buckets(after, name)
    if not b1:
        return None
    diff = {le: c - b0.get(le, 0.0) for le, c in b1.items()}
    return histogram_quantile(0.5, diff) if all(v >= 0 for v in diff.values()) else None


def server_stats(metrics_url: str, before_text: str | None, after_text: str | None) -> ServerStats:
    out = ServerStats(metrics_url=metrics_url)
    if before_text is None or after_text is None:
        return out
    before, after = parse_prometheus_text(before_text), parse_prometheus_text(after_text)
    names = {s.name for s in after}
    prefix = next((p for p in PREFIXES if any(n.startswith(p + ":") for n in names)), None)
    out.scraped, out.metric_prefix = True, prefix
    if prefix is None:
        return out
    d = lambda metric: _delta(before, after, f"{prefix}:{metric}")  # noqa: E731
    out.prefix_cache_queries = d("prefix_cache_queries_total")
    out.prefix_cache_hits = d("prefix_cache_hits_total")
    if out.prefix_cache_queries and out.prefix_cache_hits is not None:
        out.prefix_cache_hit_rate = out.prefix_cache_hits / out.prefix_cache_queries
    out.preemptions = d("num_preemptions_total")
    drafts, out.spec_draft_tokens = d("spec_decode_num_drafts_total"), d("spec_decode_num_draft_tokens_total")
    accepted = d("spec_decode_num_accepted_tokens_total")
    if out.spec_draft_tokens and accepted is not None:
        out.spec_acceptance_rate = accepted / out.spec_draft_tokens
    if drafts and accepted is not None:
        out.spec_mean_acceptance_length = 1 + accepted / drafts
    out.prompt_tokens = d("prompt_tokens_total")
    out.generation_tokens = d("generation_tokens_total")
    out.ttft_median_s = _median_delta(before, after, f"{prefix}:time_to_first_token_seconds")
    out.e2el_median_s = _median_delta(before, after, f"{prefix}:e2e_request_latency_seconds")
    return out
