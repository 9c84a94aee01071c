"""Prometheus metrics named like vLLM's, under `tokenmill:`, fed from the engine thread.

Each server gets its own CollectorRegistry, so several apps can live in one process (tests).
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tokenmill.core.outputs import SchedulerStats
from tokenmill.engine.output import FinishedRequest
from tokenmill.serve.tenants.counters import TenantCounters
from tokenmill.structured_output.checker import checker_status

if TYPE_CHECKING:
    from tokenmill.engine.stats import StepStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
STEP_PHASES = ("schedule", "offload", "prepare", "forward", "sample", "detokenize")


def _phase_seconds(step: StepStats) -> tuple[tuple[str, float], ...]:
    """Each of STEP_PHASES with its seconds in one step."""
    return (("schedule", step.schedule_s), ("offload", step.offload_s), ("prepare", step.prepare_s),
            ("forward", step.forward_s), ("sample", step.sample_s), ("detokenize", step.detokenize_s))

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_STEP_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# LoRA adapters get a label value each up to this many names; later ones count under "other" (adapters can be
# loaded at run time without end: the series must stay bounded).
MAX_ADAPTER_LABELS = 32


class GrammarCheckerCollector:
    """The grammar checker's worker (structured_output/isolation.py), read at scrape time: whether it is up, and
    how often it failed to start (while it restarts, grammar requests get 503)."""

    def __init__(self, labels: dict[str, str]) -> None:
        self._labels = labels

    def collect(self):
        status = checker_status()
        names, values = list(self._labels), list(self._labels.values())
        up = GaugeMetricFamily("tokenmill:grammar_worker_up", "1 while grammar checks can run (a checker worker "
                               "is up or can start); 0 while a worker that failed to start is being retried.",
                               labels=names)
        up.add_metric(values, 0.0 if status.state == "restarting" else 1.0)
        failures = CounterMetricFamily("tokenmill:grammar_worker_start_failures", "Grammar checker worker "
                                       "processes that failed to start.", labels=names)
        failures.add_metric(values, status.start_failures)
        return [up, failures]


class ServerMetrics:
    """Implements the AsyncLLMEngine observer: gauges after every iteration, histograms per request."""

    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # as vLLM does: the *_created series only add noise
        self.registry = CollectorRegistry(auto_describe=True)
        r, m = self.registry, ["model_name"]

        def counter(name: str, doc: str, labels=m) -> Counter:
            return Counter(f"tokenmill:{name}", doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets, labels=m) -> Histogram:
            return Histogram(f"tokenmill:{name}", doc, labels, buckets=buckets, registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tokenmill:{name}", doc, m, registry=r)

        label = {"model_name": model_name}
        self.running = gauge("num_requests_running", "Sequences in the running batch.").labels(**label)
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.").labels(**label)
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).").labels(**label)
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.").labels(**label)
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.").labels(**label)
        self.prefix_evictions = counter("prefix_cache_evictions",
                                        "Cached KV blocks reused for other content.").labels(**label)
        self.offload_saves = counter("kv_offload_saves", "KV blocks copied from the pool to the host tier.").labels(**label)
        self.offload_spills = counter("kv_offload_spills", "KV blocks written from the host tier to disk.").labels(**label)
        offload_loads = counter("kv_offload_loads", "KV blocks loaded back instead of recomputed.", m + ["tier"])
        self.offload_loads = {t: offload_loads.labels(model_name=model_name, tier=t) for t in ("host", "disk")}
        self.offload_failures = counter("kv_offload_load_failures",
                                        "Disk KV blocks that failed their checksum or were missing (recomputed).").labels(**label)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.").labels(**label)
        self.generation_tokens = counter("generation_tokens", "Generated tokens.").labels(**label)
        self.preemptions = counter("num_preemptions", "Requests preempted to free KV cache blocks.").labels(**label)
        self.spec_drafts = counter("spec_decode_num_drafts", "Verifications of at least one draft token.").labels(**label)
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.").labels(**label)
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.").labels(**label)
        self._spec_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position.",
                                 m + ["position"])
        self.kv_transfer_bytes = counter("kv_transfer_bytes", "Disaggregated prefill/decode: KV bytes handed "
                                         "over (written by a producer, loaded by a consumer).").labels(**label)
        self.kv_transfer_seconds = counter("kv_transfer_seconds", "Time spent writing or loading handed-over KV.")\
            .labels(**label)
        kv_blocks = counter("kv_transfer_blocks", "KV blocks handed over, by direction.", m + ["direction"])
        self.kv_transfer_blocks = {d: kv_blocks.labels(model_name=model_name, direction=d)
                                   for d in ("exported", "imported", "failed")}
        self._lora = {kind: counter(f"lora_{kind}", doc, m + ["adapter"]) for kind, doc in (
            ("requests", "Finished requests per LoRA adapter (after 32 adapter names: adapter=\"other\")."),
            ("prompt_tokens", "Prompt tokens of finished requests per LoRA adapter."),
            ("generation_tokens", "Generated tokens of finished requests per LoRA adapter."))}
        self._adapters: set[str] = set()
        self.tenants = TenantCounters(r, "tokenmill:", label)
        self._success = counter("request_success", "Finished requests by finish reason.", m + ["finished_reason"])
        self._model = model_name
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name=model_name, finished_reason=reason)  # export zeros from the start
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token.",
                              _LATENCY_BUCKETS).labels(**label)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens of a sequence.",
                             _ITL_BUCKETS).labels(**label)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS).labels(**label)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                    _LATENCY_BUCKETS).labels(**label)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                      _LATENCY_BUCKETS).labels(**label)
        self.decode_time = histogram("request_decode_time_seconds", "First token to finish.",
                                     _LATENCY_BUCKETS).labels(**label)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens processed per engine step.",
                                          _TOKEN_BUCKETS).labels(**label)
        step_time = histogram("step_time_seconds", "Engine step time by phase.", _STEP_BUCKETS, m + ["phase"])
        self.step_phase = {p: step_time.labels(model_name=model_name, phase=p) for p in STEP_PHASES}
        # Counters arrive as totals since a core started: one "last seen" per replica (data parallelism).
        self._lasts: dict[int, dict[str, int]] = {}
        self._last: dict[str, int] = {}
        self._gauges: dict[int, tuple[int, int, float]] = {}  # replica -> (running, waiting, kv usage)
        self._replica_lock = threading.Lock()
        r.register(GrammarCheckerCollector(label))

    # ---- observer (engine thread) ---------------------------------------------------------
    def on_iteration(self, stats: SchedulerStats, step: StepStats | None, inter_token_s: list[float],
                     replica: int = 0) -> None:
        with self._replica_lock:  # replicas report from their own threads
            self._last = self._lasts.setdefault(replica, {})
            self._gauges[replica] = (stats.num_running, stats.num_waiting, stats.kv_usage)
            g = list(self._gauges.values())
            self.running.set(sum(x[0] for x in g))
            self.waiting.set(sum(x[1] for x in g))
            self.kv_usage.set(sum(x[2] for x in g) / len(g))
            self._observe(stats, step, inter_token_s)

    def _observe(self, stats: SchedulerStats, step: StepStats | None, inter_token_s: list[float]) -> None:
        self._add(self.prefix_queries, "queries", stats.prefix_queries)
        self._add(self.prefix_hits, "hits", stats.prefix_hits)
        self._add(self.prefix_evictions, "evictions", stats.prefix_evictions)
        o = stats.offload
        if o is not None:
            self._add(self.offload_saves, "saves", o["saves"])
            self._add(self.offload_spills, "spills", o["spills"])
            self._add(self.offload_loads["host"], "host_loads", o["host_loads"])
            self._add(self.offload_loads["disk"], "disk_loads", o["disk_loads"])
            self._add(self.offload_failures, "load_failures", o["load_failures"])
        sp = stats.spec
        if sp is not None:
            self._add(self.spec_drafts, "spec_drafts", sp["num_drafts"])
            self._add(self.spec_draft_tokens, "spec_draft_tokens", sp["num_draft_tokens"])
            self._add(self.spec_accepted, "spec_accepted", sp["num_accepted_tokens"])
            for pos, n in enumerate(sp["accepted_per_pos"]):
                self._add(self._spec_pos.labels(model_name=self._model, position=str(pos)), f"spec_pos{pos}", n)
        kt = stats.kv_transfer
        if kt is not None:
            self._add(self.kv_transfer_bytes, "kvt_bytes", kt["bytes"])
            self._add(self.kv_transfer_blocks["exported"], "kvt_exported", kt["exported_blocks"])
            self._add(self.kv_transfer_blocks["imported"], "kvt_imported", kt["imported_blocks"])
            self._add(self.kv_transfer_blocks["failed"], "kvt_failed", kt["import_failures"])
            delta = kt["seconds"] - self._last.get("kvt_seconds", 0.0)
            if delta > 0:
                self.kv_transfer_seconds.inc(delta)
            self._last["kvt_seconds"] = kt["seconds"]
        self._add(self.preemptions, "preemptions", stats.num_preemptions)
        self._add(self.generation_tokens, "generation", stats.generation_tokens)
        for s in inter_token_s:
            self.itl.observe(s)
        if step is not None and step.num_tokens > 0:
            self.iteration_tokens.observe(step.num_tokens)
            for phase, seconds in _phase_seconds(step):
                self.step_phase[phase].observe(seconds)

    def _add(self, counter: Counter, key: str, total: int) -> None:
        delta = total - self._last.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._last[key] = total

    def on_request_finished(self, r: FinishedRequest) -> None:
        self._success.labels(model_name=self._model, finished_reason=r.finish_reason).inc()
        self.prompt_tokens.inc(r.num_prompt_tokens)
        if r.adapter is not None:
            if r.adapter not in self._adapters and len(self._adapters) < MAX_ADAPTER_LABELS:
                self._adapters.add(r.adapter)
            adapter = r.adapter if r.adapter in self._adapters else "other"
            for kind, n in (("requests", 1), ("prompt_tokens", r.num_prompt_tokens),
                            ("generation_tokens", r.num_generation_tokens)):
                self._lora[kind].labels(model_name=self._model, adapter=adapter).inc(n)
        self.e2e.observe(max(0.0, r.finished_time - r.arrival_time))
        if r.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, r.first_scheduled_time - r.arrival_time))
        if r.first_token_time is not None:
            self.ttft.observe(max(0.0, r.first_token_time - r.arrival_time))
            self.decode_time.observe(max(0.0, r.finished_time - r.first_token_time))
            if r.first_scheduled_time is not None:
                self.prefill_time.observe(max(0.0, r.first_token_time - r.first_scheduled_time))

    # ---- exposition -----------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)
