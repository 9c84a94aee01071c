"""Fault injection: make one stage of the engine step raise for a chosen request.

Tests (and `benchmarks/soak.py`) set `TOKENMILL_FAULTS` to a comma-separated list of `stage=request_id`
entries, e.g. `TOKENMILL_FAULTS=forward=victim,output=poison-1`. The engine calls `maybe_raise(stage, ids)`
at each stage with the request ids it is handling; when a listed id is among them (a listed id also
matches its n > 1 children, `id-0`, `id-1`, ...), it raises `InjectedFault`. `*` matches every request,
and `stage=id@P` raises with probability P (the soak's random faults).

The variable is read at every call (a dict lookup: the stages call this a few times per step, not per
token), so a test can set it with monkeypatch in-process, and a spawned engine-core process inherits it.
Unset, the cost is one environment lookup: callers pass the request ids lazily (a generator), and a call
site that needs real work to find them checks `enabled()` first.

Stages, in step order: `schedule` (per request the scheduler considers), `transfer` (KV tier and connector
transfers, with the requests that load blocks, and `kv-tier` when the step also saves or spills), `build_batch`, `bitmask` (grammar masks), `forward`,
`sample`, `propose` (in the model runner: speculative drafting for the requests that will draft), `update` (per request, applying the step's tokens), `output` (per request,
the output processor: detokenizing, stop strings, logprobs).
"""
from __future__ import annotations

import os
import random
from typing import Iterable

ENV = "TOKENMILL_FAULTS"
STAGES = ("schedule", "transfer", "build_batch", "bitmask", "forward", "sample", "propose", "update", "output")


class InjectedFault(RuntimeError):
    """Raised by maybe_raise; a test tells it from a real bug by its type and message."""


_parsed: tuple[str, list[tuple[str, str, float]]] = ("", [])


def _rules() -> list[tuple[str, str, float]]:
    global _parsed
    spec = os.environ.get(ENV, "")
    if spec != _parsed[0]:
        rules = []
        for item in filter(None, (s.strip() for s in spec.split(","))):
            stage, _, target = item.partition("=")
            target, _, p = target.partition("@")
            if stage not in STAGES:
                raise ValueError(f"{ENV}: unknown stage {stage!r} (stages: {', '.join(STAGES)}).")
            rules.append((stage, target, float(p) if p else 1.0))
        _parsed = (spec, rules)
    return _parsed[1]


def _matches(target: str, request_id: str) -> bool:
    if target == "*" or request_id == target:
        return True
    base, _, index = request_id.rpartition("-")
    return base == target and index.isdigit()


def enabled() -> bool:
    return ENV in os.environ


def maybe_raise(stage: str, request_ids: Iterable[str]) -> None:
    """Raise InjectedFault if a rule names `stage` and one of `request_ids` (iterated only then)."""
    if ENV not in os.environ:
        return
    rules = [r for r in _rules() if r[0] == stage]
    if not rules:
        return
    request_ids = list(request_ids)
    for _, target, p in rules:
        for rid in request_ids:
            if _matches(target, rid) and (p >= 1.0 or random.random() < p):
                raise InjectedFault(f"injected fault at {stage} for request {rid}")
