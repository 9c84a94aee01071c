"""examples/grafana/tokenmill.json: every PromQL query names only metrics the server exports (read from the
server's own registry, serve/metrics.py, with the suffixes Prometheus adds), groups only by labels those metrics
have, and filters every selector by the dashboard's model_name variable."""
from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram

from tokenmill.serve.metrics import ServerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "tokenmill.json"
METRIC = re.compile(r"tokenmill:[A-Za-z0-9_:]+")


def exported() -> dict[str, set[str]]:
    """Every series name /metrics can carry -> its label names (le for buckets)."""
    metrics = ServerMetrics("m")
    out: dict[str, set[str]] = {}
    for collector in list(metrics.registry._collector_to_names):  # the registry's metrics and custom collectors
        for family in collector.describe() if hasattr(collector, "describe") else collector.collect():
            labels = set(getattr(collector, "_labelnames", ())) | {"model_name"}
            if isinstance(collector, Counter) or family.type == "counter":
                out[family.name + "_total"] = labels
            elif isinstance(collector, Histogram) or family.type == "histogram":
                out[family.name + "_bucket"] = labels | {"le"}
                out[family.name + "_sum"] = out[family.name + "_count"] = labels
            elif isinstance(collector, Gauge) or family.type == "gauge":
                out[family.name] = labels
    return out


def queries(dash: dict) -> list[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    return exprs


def test_every_query_names_an_exported_metric():
    dash = json.loads(DASHBOARD.read_text())
    names = exported()
    assert len(names) > 40 and "tokenmill:num_requests_running" in names
    assert "tokenmill:tenant_requests_total" in names and "tokenmill:step_time_seconds_bucket" in names
    exprs = queries(dash)
    assert len(exprs) >= 14 and all(p["targets"] for p in dash["panels"])
    used = set()
    for expr in exprs:
        found = METRIC.findall(expr)
        assert found, expr
        for name in found:
            assert name in names, f"{name} is not exported by the server ({expr})"
            used.add(name)
        for group in re.findall(r"by \(([^)]*)\)", expr):  # grouped by labels the summed metrics have
            for label in (g.strip() for g in group.split(",")):
                assert all(label in names[n] for n in found), (label, expr)
    # The headline series are all on the dashboard.
    for name in ("prompt_tokens_total", "generation_tokens_total", "num_requests_waiting", "kv_cache_usage_perc",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "prefix_cache_hits_total", "num_preemptions_total"):
        assert "tokenmill:" + name in used, name


def test_every_selector_follows_the_model_variable():
    dash = json.loads(DASHBOARD.read_text())
    for p in dash["panels"]:
        for t in p["targets"]:
            for selector in re.findall(r"tokenmill:[A-Za-z0-9_:]+(\{[^}]*\})?", t["expr"]):
                assert selector == '{model_name=~"$model_name"}', (p["title"], t["expr"])
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}"
    assert [v["name"] for v in dash["templating"]["list"]] == ["DS_PROMETHEUS", "model_name"]
