"""`tokenmill bench serve --tenants FILE`: several tenants (API keys) load one server in the same run, each
with its own prompts, arrival rate and SLOs; the result reports each tenant's latency, throughput, goodput
and SLO attainment, and the whole run's.

```yaml
tenants:
  - name: interactive
    api_key: sk-interactive
    request_rate: 2            # requests/s (Poisson); default: --request-rate
    num_prompts: 40            # default: --num-prompts / the dataset's default
    max_concurrency: 8         # default: --max-concurrency
    goodput: {ttft: 1000, tpot: 100}   # milliseconds; default: --goodput
    dataset: random            # default: --dataset, with the command line's dataset flags
    dataset_params: {random_input_len: 128, random_output_len: 64}
    extra_body: {priority: 0}
  - name: batch
    api_key: sk-batch
    request_rate: inf
    num_prompts: 8
    dataset_params: {random_input_len: 1500, random_output_len: 128}
```
"""
from __future__ import annotations

import argparse
import asyncio
import math
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

from tokenmill.bench.client import ClientConfig, LoadConfig, RequestRecord, make_client, run_requests
from tokenmill.bench.datasets import DATASETS, DatasetSpec, build_dataset
from tokenmill.bench.metrics import SLO_KEYS, Goodput, meets_slos, per_second, summarize

TENANT_FIELDS = ("name", "api_key", "request_rate", "num_prompts", "max_concurrency", "burstiness", "goodput",
                 "dataset", "dataset_params", "extra_body")


@dataclass
class TenantLoad:
    name: str
    api_key: str | None
    spec: DatasetSpec
    load: LoadConfig
    slos_ms: dict[str, float] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)

    def config(self) -> dict[str, Any]:
        rate = self.load.request_rate
        return {"name": self.name, "dataset": self.spec.name, "num_prompts": self.spec.num_prompts,
                "request_rate": "inf" if math.isinf(rate) else rate, "burstiness": self.load.burstiness,
                "max_concurrency": self.load.max_concurrency, "goodput_slos_ms": self.slos_ms or None,
                "extra_body": self.extra_body}


def load_tenants(path: str, args: argparse.Namespace, base_spec: DatasetSpec, base_slos: dict[str, float],
                 progress: bool) -> list[TenantLoad]:
    """The tenants of FILE over the command line's defaults; ValueError names the file and the problem."""
    from tokenmill.serve.tenants.keys import parse_json_or_yaml

    with open(path, encoding="utf-8") as f:
        doc = parse_json_or_yaml(f.read(), path)
    entries = doc.get("tenants") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: needs a non-empty list `tenants`.")
    out: list[TenantLoad] = []
    for i, t in enumerate(entries):
        where = f"{path}: tenant {i + 1}"
        if not isinstance(t, dict):
            raise ValueError(f"{where} must be a mapping.")
        unknown = sorted(set(t) - set(TENANT_FIELDS))
        if unknown:
            raise ValueError(f"{where} has unknown keys {unknown}; known: {list(TENANT_FIELDS)}.")
        name = str(t.get("name") or f"tenant-{i + 1}")
        dataset = t.get("dataset", base_spec.name)
        if dataset not in DATASETS:
            raise ValueError(f"{where}: dataset must be one of {', '.join(DATASETS)}, got {dataset!r}.")
        params = t.get("dataset_params") or {}
        known = {f for f in DatasetSpec.__dataclass_fields__} - {"name", "num_prompts", "seed"}
        if not isinstance(params, dict) or set(params) - known:
            raise ValueError(f"{where}: dataset_params may set {sorted(known)}.")
        # Each tenant draws its own prompts: another seed, so tenants do not share prefixes by accident.
        spec = replace(base_spec, name=dataset, num_prompts=t.get("num_prompts", base_spec.num_prompts),
                       seed=base_spec.seed + 1000 * (i + 1), **params)
        rate = t.get("request_rate", args.request_rate)
        rate = math.inf if rate in ("inf", None) else float(rate)
        if not rate > 0:
            raise ValueError(f"{where}: request_rate must be positive or inf.")
        goodput = t.get("goodput", base_slos)
        if not isinstance(goodput, dict) or set(goodput) - set(SLO_KEYS):
            raise ValueError(f"{where}: goodput maps {', '.join(SLO_KEYS)} to milliseconds.")
        load = LoadConfig(request_rate=rate, burstiness=float(t.get("burstiness", args.burstiness)),
                          max_concurrency=t.get("max_concurrency", args.max_concurrency),
                          seed=base_spec.seed + i, progress=progress)
        extra = {**args.extra_body, **(t.get("extra_body") or {})}
        out.append(TenantLoad(name, t.get("api_key"), spec, load, {k: float(v) for k, v in goodput.items()}, extra))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: tenant names must differ.")
    return out


@dataclass
class TenantRun:
    tenant: TenantLoad
    records: list[RequestRecord]


async def run_tenants(base: ClientConfig, tenants: list[TenantLoad], tokenizer, transport=None) -> tuple[
        list[TenantRun], str]:
    """Every tenant's requests at its own arrival times, all from the same start."""
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()

    async def one(t: TenantLoad) -> TenantRun:
        cfg = replace(base, api_key=t.api_key, extra_body=t.extra_body)
        async with make_client(t.load.max_concurrency, transport) as client:
            records = await run_requests(client, cfg, build_dataset(t.spec, tokenizer), t.load, tokenizer,
                                         desc=t.name, t0=t0)
        return TenantRun(t, records)

    return list(await asyncio.gather(*(one(t) for t in tenants))), started_at


def tenant_results(runs: list[TenantRun], cost_per_hour: float | None) -> tuple[list[dict], list[RequestRecord]]:
    """Each tenant's summary (goodput against its own SLOs, SLO attainment) and all records renumbered in
    tenant order (a tenant's are requests[first_request : first_request + num_requests])."""
    results, records = [], []
    for run in runs:
        s = summarize(run.records, run.tenant.slos_ms or None, cost_per_hour)
        results.append({"name": run.tenant.name, "config": run.tenant.config(), "summary": asdict(s),
                        "slo_attainment": s.goodput.fraction if s.goodput is not None else None,
                        "first_request": len(records), "num_requests": len(run.records)})
        records += [replace(r, index=len(records) + i) for i, r in enumerate(run.records)]
    return results, records


def overall_goodput(runs: list[TenantRun], seconds: float) -> Goodput:
    """Requests meeting their own tenant's SLOs (a tenant without SLOs: every successful request)."""
    good = sum(meets_slos(r, run.tenant.slos_ms) for run in runs for r in run.records)
    total = sum(len(run.records) for run in runs)
    return Goodput(slos_ms={}, good_requests=good, request_rate=per_second(good, seconds),
                   fraction=good / total if total else None)


def format_tenants(result: dict[str, Any]) -> str:
    """One line per tenant: what each got from the shared server."""
    rows = [("tenant", "reqs", "ok", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
             "SLO met", "goodput/s")]

    def f(v, digits=1) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    for t in result.get("tenants") or []:
        s = t["summary"]
        g = s.get("goodput") or {}
        rows.append((t["name"], str(s["num_requests"]), str(s["completed"]), f(s["request_throughput"], 2),
                     f(s["output_throughput"]), f(s["ttft_ms"]["median"]), f(s["ttft_ms"]["p99"]),
                     f(s["tpot_ms"]["median"]), f(s["tpot_ms"]["p99"]),
                     "-" if t["slo_attainment"] is None else f"{100 * t['slo_attainment']:.0f}%",
                     f(g.get("request_rate"), 2)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)
