"""tokenmill bench: metric maths against hand-computed examples, Prometheus parsing, the result
schema and compare."""
import json
import math

import jsonschema
import pytest

from tokenmill.bench.client import RequestError, RequestRecord
from tokenmill.bench.metrics import (concurrency_steps, cost, goodput, meets_slos, parse_goodput, peak_concurrency,
                                     percentile, stats, summarize, throughput_timeline, tpot)
from tokenmill.bench.prometheus import histogram_quantile, parse_prometheus_text, server_stats
from tokenmill.bench.report import build_result, compare, format_summary, load_schema, write_result


def rec(i, start, end, ttft=None, itl=(), out=0, inp=0, error=None, chunks=None):
    return RequestRecord(index=i, start=start, end=end, prompt_len=inp, output_len=out, ttft=ttft, itl=list(itl),
                         input_tokens=inp, output_tokens=out, chunks=len(itl) + 1 if chunks is None else chunks,
                         error=error)


# Four requests (seconds). r3 failed; it still counts in the duration (0 .. 2.5).
RECORDS = [
    rec(0, 0.0, 1.0, ttft=0.2, itl=[0.2] * 4, out=5, inp=10),   # tpot (1.0-0.2)/4 = 0.2
    rec(1, 0.5, 2.0, ttft=0.5, itl=[0.5, 0.5], out=3, inp=20),  # e2el 1.5, tpot (1.5-0.5)/2 = 0.5
    rec(2, 1.0, 1.5, ttft=0.3, out=1, inp=30, chunks=1),        # one token: no TPOT
    rec(3, 1.5, 2.5, error=RequestError("InternalServerError", "boom", 500), inp=40),
]


def test_percentile_is_linear_interpolation():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)   # rank 0.9*3 = 2.7 -> 3 + 0.7
    assert percentile([5], 99) == 5
    assert percentile([3, 1, 2], 0) == 1 and percentile([3, 1, 2], 100) == 3
    with pytest.raises(ValueError):
        percentile([], 50)


def test_stats_in_ms_and_empty():
    s = stats([0.1, 0.2, 0.3, 0.4])
    assert (s.count, s.mean, s.median, s.max, s.min) == (4, pytest.approx(250), pytest.approx(250), pytest.approx(400),
                                                        pytest.approx(100))
    assert s.p99 == pytest.approx(397)  # rank 0.99*3 = 2.97 -> 300 + 0.97*100
    empty = stats([])
    assert empty.count == 0 and empty.mean is None and empty.p99 is None


def test_tpot_definition():
    assert tpot(e2el=1.0, ttft=0.1, output_tokens=10) == pytest.approx(0.1)
    assert tpot(e2el=1.0, ttft=0.1, output_tokens=2) == pytest.approx(0.9)
    assert tpot(e2el=1.0, ttft=0.1, output_tokens=1) is None
    assert tpot(e2el=1.0, ttft=None, output_tokens=5) is None


def test_summary_hand_computed():
    s = summarize(RECORDS)
    assert (s.num_requests, s.completed, s.failed) == (4, 3, 1)
    assert s.duration_s == pytest.approx(2.5)
    assert (s.total_input_tokens, s.total_output_tokens) == (60, 9)  # failed requests' tokens excluded
    assert s.request_throughput == pytest.approx(3 / 2.5)
    assert s.input_throughput == pytest.approx(24.0)
    assert s.output_throughput == pytest.approx(3.6)
    assert s.total_token_throughput == pytest.approx(27.6)
    assert s.ttft_ms.mean == pytest.approx(1000 / 3)
    assert s.ttft_ms.median == pytest.approx(300)
    assert s.ttft_ms.p90 == pytest.approx(460)  # [200, 300, 500], rank 1.8 -> 300 + 0.8*200
    assert s.tpot_ms.count == 2 and s.tpot_ms.mean == pytest.approx(350)
    assert s.tpot_ms.p99 == pytest.approx(497)
    assert s.itl_ms.count == 6 and s.itl_ms.mean == pytest.approx(300) and s.itl_ms.median == pytest.approx(200)
    assert s.e2el_ms.mean == pytest.approx(1000) and s.e2el_ms.max == pytest.approx(1500)
    assert s.peak_concurrency == 2
    assert s.mean_concurrency == pytest.approx(4.0 / 2.5)
    assert s.errors.total == 1 and s.errors.by_type == {"HTTP 500 InternalServerError": 1}
    assert s.errors.examples[0] == {"index": 3, "type": "InternalServerError", "status": 500, "message": "boom"}
    assert s.goodput is None and s.cost is None


def test_goodput():
    slos = parse_goodput(["ttft:400", "tpot:300"])
    assert slos == {"ttft": 400.0, "tpot": 300.0}
    # r0 meets both; r1 misses TTFT; r2 has one token (no TPOT: met); r3 failed.
    assert [meets_slos(r, slos) for r in RECORDS] == [True, False, True, False]
    g = goodput(RECORDS, slos, 2.5)
    assert (g.good_requests, g.request_rate, g.fraction) == (2, pytest.approx(0.8), 0.5)
    assert goodput(RECORDS, {"e2el": 1200}, 2.5).good_requests == 2  # 1000, 1500, 500 ms
    assert goodput(RECORDS, {"tpot": 250}, 2.5).good_requests == 2   # r1's 500 ms TPOT misses
    assert summarize(RECORDS, slos).goodput.good_requests == 2
    assert not meets_slos(rec(9, 0, 1, ttft=None, out=0), {"ttft": 1e9})  # no first token: fails a TTFT SLO


def test_parse_goodput_rejects_bad_items():
    assert parse_goodput(["ttft:100 e2el:2000"]) == {"ttft": 100.0, "e2el": 2000.0}
    assert parse_goodput(None) == {}
    for bad in (["ttft"], ["latency:5"], ["ttft:abc"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_cost_attributes_all_machine_time_to_each_unit():
    c = cost(cost_per_hour=36.0, seconds=2.5, completed=3, input_tokens=60, output_tokens=9)
    assert c.total_usd == pytest.approx(0.025)
    assert c.per_request_usd == pytest.approx(0.025 / 3)
    assert c.per_1m_input_tokens_usd == pytest.approx(0.025 / 60 * 1e6)
    assert c.per_1m_output_tokens_usd == pytest.approx(0.025 / 9 * 1e6)
    assert c.per_1m_total_tokens_usd == pytest.approx(0.025 / 69 * 1e6)
    none = cost(1.0, 10.0, 0, 0, 0)
    assert none.per_request_usd is None and none.per_1m_output_tokens_usd is None
    assert summarize(RECORDS, cost_per_hour=36.0).cost.per_1m_output_tokens_usd == pytest.approx(0.025 / 9 * 1e6)


def test_concurrency():
    assert peak_concurrency([(0, 2), (1, 3), (2, 4)]) == 2  # one ends at 2 as the next starts
    assert peak_concurrency([(0, 5), (1, 2), (1, 3), (1.5, 4)]) == 4
    assert peak_concurrency([]) == 0
    assert concurrency_steps([(0, 1), (0.5, 2)]) == [(0, 1), (0.5, 2), (1, 1), (2, 0)]


def test_throughput_timeline_conserves_tokens():
    starts, tokens, done = throughput_timeline(RECORDS, 0.5)
    assert len(starts) == 5  # 2.5 s in 0.5 s bins
    assert sum(t * 0.5 for t in tokens) == pytest.approx(9)
    assert sum(d * 0.5 for d in done) == pytest.approx(3)
    # r0's chunks at 0.2, 0.4, 0.6, 0.8, 1.0 s: two in the first bin
    assert tokens[0] * 0.5 == pytest.approx(2)


# ---- Prometheus -------------------------------------------------------------------------------
BEFORE = """
# HELP tokenmill:prefix_cache_queries_total Prefix cache queries, in tokens.
# TYPE tokenmill:prefix_cache_queries_total counter
tokenmill:prefix_cache_queries_total{model_name="m"} 100.0
tokenmill:prefix_cache_queries_created{model_name="m"} 1.7e9
tokenmill:prefix_cache_hits_total{model_name="m"} 10.0
tokenmill:num_preemptions_total{model_name="m"} 1.0
tokenmill:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 1.0
tokenmill:time_to_first_token_seconds_bucket{le="0.5",model_name="m"} 1.0
tokenmill:time_to_first_token_seconds_bucket{le="1.0",model_name="m"} 1.0
tokenmill:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 1.0
"""
AFTER = """
tokenmill:prefix_cache_queries_total{model_name="m"} 300.0
tokenmill:prefix_cache_hits_total{model_name="m"} 160.0
tokenmill:num_preemptions_total{model_name="m"} 3.0
tokenmill:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 3.0
tokenmill:time_to_first_token_seconds_bucket{le="0.5",model_name="m"} 7.0
tokenmill:time_to_first_token_seconds_bucket{le="1.0",model_name="m"} 9.0
tokenmill:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 11.0
"""


def test_parse_prometheus_text_labels_and_specials():
    text = ('a_total{path="/x",msg="say \\"hi\\", ok"} 3\n'
            "b 1.5e3 1700000000000\n"
            'c{le="+Inf"} +Inf\n'
            "# comment\n"
            "garbage line without value\n"
            'd{unterminated="x} 4\n')
    samples = {s.name: s for s in parse_prometheus_text(text)}
    assert dict(samples["a_total"].labels) == {"path": "/x", "msg": 'say "hi", ok'}
    assert samples["a_total"].value == 3 and samples["b"].value == 1500
    assert math.isinf(samples["c"].value)
    assert "d" not in samples and "garbage" not in samples


def test_histogram_quantile():
    b = {0.1: 2, 0.5: 6, 1.0: 8, math.inf: 10}
    assert histogram_quantile(0.5, b) == pytest.approx(0.4)   # rank 5: 0.1 + 0.4 * (5-2)/(6-2)
    assert histogram_quantile(0.1, b) == pytest.approx(0.05)  # rank 1 in the first bucket, lower bound 0
    assert histogram_quantile(0.95, b) == 1.0                 # in +Inf: the largest finite bound
    assert histogram_quantile(0.5, {}) is None
    assert histogram_quantile(0.5, {0.1: 0, math.inf: 0}) is None


def test_server_stats_deltas():
    s = server_stats("http://x/metrics", BEFORE, AFTER)
    assert s.scraped and s.metric_prefix == "tokenmill"
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.preemptions) == (200, 150, 2)
    assert s.prefix_cache_hit_rate == pytest.approx(0.75)
    # run's TTFT buckets: {0.1: 2, 0.5: 6, 1.0: 8, inf: 10} -> median 0.4 s
    assert s.ttft_median_s == pytest.approx(0.4)
    assert s.e2el_median_s is None and s.prompt_tokens is None


def test_server_stats_absent_or_vllm_or_reset():
    assert not server_stats("u", None, AFTER).scraped
    bare = server_stats("u", "", "process_cpu_seconds_total 3\n")
    assert bare.scraped and bare.metric_prefix is None and bare.prefix_cache_hit_rate is None
    v = server_stats("u", "vllm:num_preemptions_total 5\n", "vllm:num_preemptions_total 9\nvllm:prefix_cache_queries_total 0\n")
    assert v.metric_prefix == "vllm" and v.preemptions == 4
    assert v.prefix_cache_queries == 0 and v.prefix_cache_hit_rate is None  # no queries: no rate
    reset = server_stats("u", "tokenmill:num_preemptions_total 9\n", "tokenmill:num_preemptions_total 2\n")
    assert reset.preemptions is None


# ---- result JSON and compare -----------------------------------------------------------------
CONFIG = {
    "base_url": "http://x", "model": "m", "endpoint": "completions", "dataset": "random",
    "dataset_params": {"random_input_len": 10, "random_output_len": 5, "random_range_ratio": 0.0},
    "num_prompts": 4, "num_warmups": 0, "request_rate": "inf", "burstiness": 1.0, "max_concurrency": None,
    "ignore_eos": True, "temperature": 0.0, "seed": 0, "tokenizer": None, "goodput_slos_ms": {"ttft": 400.0},
    "cost_per_hour": 36.0, "extra_body": {},
}


def _result(records=RECORDS):
    summary = summarize(records, {"ttft": 400.0}, 36.0)
    return build_result(CONFIG, summary, server_stats("http://x/metrics", BEFORE, AFTER), records,
                        "2025-01-01T00:00:00+00:00")


def test_result_validates_against_schema(tmp_path):
    result = _result()
    jsonschema.validate(result, load_schema())
    path = tmp_path / "r.json"
    write_result(result, str(path))
    assert json.loads(path.read_text()) == json.loads(json.dumps(result))
    broken = json.loads(json.dumps(result))
    del broken["summary"]["ttft_ms"]["p99"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, load_schema())


def test_format_summary_lists_metrics_and_errors():
    text = format_summary(_result())
    for needle in ("TTFT median (ms)", "300.00", "Goodput (req/s)", "HTTP 500 InternalServerError",
                   "Prefix cache hit rate", "0.750", "Cost per 1M output tokens"):
        assert needle in text


def test_compare_side_by_side_with_ratios(tmp_path):
    a, b = tmp_path / "base.json", tmp_path / "fast.json"
    write_result(_result(), str(a))
    # Same requests at twice the speed: half the duration and latencies.
    fast = [rec(r.index, r.start / 2, r.end / 2, ttft=r.ttft / 2 if r.ttft else None, itl=[g / 2 for g in r.itl],
                out=r.output_tokens, inp=r.input_tokens, error=r.error, chunks=r.chunks) for r in RECORDS]
    write_result(_result(fast), str(b))
    table = compare([str(a), str(b)])
    lines = {line.split("  ")[0].strip(): line for line in table.splitlines()}
    assert "fast/base" in table.splitlines()[0]
    assert lines["Requests/s"].rstrip().endswith("2.00x")
    assert lines["TTFT median (ms)"].rstrip().endswith("0.50x")
    assert lines["Failed"].rstrip().endswith("1.00x")
