"""The roofline maths of tokenmill.diagnostics on hand-built steps, calibration caching and re-calibration
(a peak the engine beats or one measured under load), and attention's time and K/V bytes per step on tiny
models (engine, /v1/diagnostics, bench throughput)."""
from __future__ import annotations

import json
import os
import re

import pytest
import torch

from tokenmill import diagnostics as d
from tokenmill.diagnostics import calibration as cal  # where calibrate looks its names up
from tokenmill.engine.engine import StepStats

PEAKS = d.Peaks(flops=100e9, bandwidth=10e9, dtype="float32", threads=2, device="cpu", measured_at=0.0)
# 1e8 GEMM params of which 1e7 is the LM head; 1e9 bytes of weights; 1e4 KV bytes per token.
COST = d.ModelCost(matmul_params=100_000_000, weight_bytes=1_000_000_000, kv_bytes_per_token=10_000,
                   attn_flops_per_pair=1000, lm_head_params=10_000_000)


def step(tokens, sampled, forward, kv=0, pairs=0, other=0.0):
    return StepStats(schedule_s=other, forward_s=forward, num_tokens=tokens, num_sampled=sampled,
                     kv_tokens=kv, attn_pairs=pairs)


def test_step_flops_and_bytes():
    # body 9e7 params x 2 x 10 tokens + head 1e7 x 2 x 2 sampled + 1000 x 50 pairs
    assert COST.step_flops(10, 2, 50) == 2 * 9e7 * 10 + 2 * 1e7 * 2 + 50_000
    assert COST.step_bytes(10, 90) == 1e9 + 10_000 * 100


def test_bandwidth_bound_decode():
    # One token: 2e8 FLOPs (2 ms at peak) vs 1e9 bytes (100 ms at peak); took 150 ms.
    r = d.diagnose([step(1, 1, 0.150)], COST, PEAKS)
    assert r["verdict"] == "bandwidth-bound"
    assert r["achieved"]["bytes_per_s"] == pytest.approx((1e9 + 1e4) / 0.150)
    assert r["roofline"]["memory_s"] == pytest.approx((1e9 + 1e4) / 10e9)


def test_compute_bound_prefill():
    # 1000 tokens: ~1.8e11 FLOPs (1.8 s at peak) vs ~1e9 bytes (0.1 s); took 2.5 s.
    r = d.diagnose([step(1000, 1, 2.5)], COST, PEAKS)
    assert r["verdict"] == "compute-bound"
    assert 0.7 < r["achieved"]["flops_share_of_peak"] < 0.75


def test_overhead_bound_when_time_is_unexplained():
    # Needs ~0.1 s at peak but took 1 s, most of it outside the forward pass.
    r = d.diagnose([step(1, 1, 0.2, other=0.8)], COST, PEAKS)
    assert r["verdict"] == "overhead-bound"
    assert "outside the forward pass" in r["reason"]
    assert r["time_share"]["schedule"] == pytest.approx(0.8)


def test_idle_counts_in_the_split_not_the_verdict():
    r = d.diagnose([step(1, 1, 0.15)], COST, PEAKS, idle_s=0.85)
    assert r["verdict"] == "bandwidth-bound"
    assert r["time_share"]["idle"] == pytest.approx(0.85)


def test_calibration_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    calls = []

    def fake(device, dtype):
        calls.append(1)
        return PEAKS

    monkeypatch.setattr(cal, "measure_peaks", fake)
    import torch

    assert d.load_or_measure_peaks("cpu", torch.float32).flops == PEAKS.flops
    assert d.load_or_measure_peaks("cpu", torch.float32).bandwidth == PEAKS.bandwidth
    assert len(calls) == 1 and (tmp_path / "calibration.json").is_file()


def test_engine_report_on_tiny_model(tmp_path, monkeypatch):
    from tiny import make_tiny_model
    from tokenmill import LLM, SamplingParams

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cal, "measure_peaks", lambda device, dtype: PEAKS)
    llm = LLM(str(make_tiny_model(tmp_path / "m", "llama")), max_model_len=128, num_gpu_blocks_override=32)
    llm.generate([[5, 6, 7, 8]] * 3, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    cost = d.ModelCost.from_engine(llm.engine)
    cfg = llm.engine.hf_config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_layer = (cfg.hidden_size * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * head_dim
                 + cfg.num_attention_heads * head_dim * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size)
    assert cost.matmul_params == cfg.num_hidden_layers * per_layer + cfg.vocab_size * cfg.hidden_size
    r = d.engine_diagnostics(llm.engine)
    assert r["tokens"] == 3 * 4 + 3 * 3  # three 4-token prompts, then 3 decode steps of 3 requests
    assert r["verdict"] in ("compute-bound", "bandwidth-bound", "overhead-bound")
    assert "verdict:" in d.format_report(r) and "attention:" in d.format_report(r)
    assert r["attention"]["timed"] and 0 < r["attention"]["share_of_forward"] <= 1
    assert r["scheduling_policy"] == {"name": "fcfs"}
    kv = llm.engine.kv
    assert r["kv_cache"] == {"group_windows": [None], "num_blocks": kv.num_blocks, "free_blocks": kv.num_blocks,
                             "released_blocks": 0}


def test_steps_carry_the_idle_time_before_them():
    from tokenmill.engine.engine import EngineStats

    stats = EngineStats()
    stats.idle_s = 5.0  # waiting for the first request
    stats.add(step(4, 1, 0.1))
    stats.add(StepStats())  # an empty step stays out of the history; the idle after it still counts
    stats.idle_s += 0.3
    stats.add(step(1, 1, 0.1))
    stats.add(step(1, 1, 0.1))
    stats.idle_s += 7.0  # after the last step: no step carries it yet
    assert [s.idle_before_s for s in stats.history] == pytest.approx([5.0, 0.3, 0.0])


# ---- attention: time per step and the K/V bytes it reads ------------------------------------------
def test_attention_summary_from_hand_built_steps():
    steps = [StepStats(forward_s=0.1, num_tokens=1, attn_s=0.02, attn_bytes=100_000_000),
             StepStats(forward_s=0.1, num_tokens=1, attn_s=0.03, attn_bytes=150_000_000)]
    a = d.diagnose(steps, COST, PEAKS)["attention"]
    assert a["timed"] and a["time_s"] == pytest.approx(0.05)
    assert a["s_per_step"] == pytest.approx(0.025)
    assert a["share_of_forward"] == pytest.approx(0.25)
    assert a["bytes"] == 250_000_000 and a["bytes_per_step"] == pytest.approx(125e6)
    assert a["bytes_per_s"] == pytest.approx(5e9)  # 250 MB in 50 ms
    assert a["bandwidth_share_of_peak"] == pytest.approx(0.5)  # of the 10 GB/s calibrated
    assert a["memory_s_at_peak"] == pytest.approx(0.025)
    line = d.format_attention(a, PEAKS.bandwidth)
    assert "25.000 ms/step (25% of forward)" in line and "125.0 MB K/V read/step" in line
    assert "5.00 GB/s (50% of 10 calibrated)" in line


def test_untimed_attention_reports_none_not_zero():
    # CUDA without TOKENMILL_TIME_ATTENTION=1: the bytes are known, the time is not.
    a = d.diagnose([StepStats(forward_s=0.1, num_tokens=1, attn_bytes=1000)], COST, PEAKS)["attention"]
    assert not a["timed"] and a["bytes"] == 1000
    assert a["time_s"] is a["s_per_step"] is a["share_of_forward"] is a["bytes_per_s"] is None
    assert a["bandwidth_share_of_peak"] is None
    assert "not timed" in d.format_attention(a, PEAKS.bandwidth)


def _kv_bytes_per_token_per_layer(llm) -> int:
    cfg = llm.engine.hf_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_key_value_heads * head_dim * llm.engine.runner.kv_dtype.itemsize


def test_attention_time_and_bytes_per_step_on_tiny_llama(tiny_llama):
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(tiny_llama), max_model_len=128, num_gpu_blocks_override=32)
    assert llm.engine.runner.attn_timer is not None  # CPU: timed by default
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    steps = list(llm.engine.stats.history)
    assert len(steps) == 3  # the 5-token prompt, then two decode steps
    for s in steps:
        assert 0 < s.attn_s <= s.forward_s
    # 2 layers x 2 KV heads x head_dim 16 x (K and V) x 4 bytes (float32) per attended token.
    per_token = llm.engine.hf_config.num_hidden_layers * _kv_bytes_per_token_per_layer(llm)
    assert per_token == 2 * 2 * 16 * 2 * 4
    # The prompt attends to its 5 tokens; each decode to the cache so far plus itself: 6, then 7.
    assert [s.attn_bytes for s in steps] == [5 * per_token, 6 * per_token, 7 * per_token]
    stats = llm.engine.stats
    assert stats.attn_bytes == 18 * per_token and stats.attn_s == pytest.approx(sum(s.attn_s for s in steps))


def test_attention_bytes_clip_to_the_sliding_window(tmp_path):
    from tiny import make_tiny_model
    from tokenmill import LLM, SamplingParams

    # One sliding layer (window 4) and one full layer.
    path = make_tiny_model(tmp_path / "g", "gemma3", sliding_window=4,
                           layer_types=["sliding_attention", "full_attention"])
    llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=32)
    assert [layer.self_attn.attn.sliding_window for layer in llm.engine.model.layers] == [4, None]
    per_layer = _kv_bytes_per_token_per_layer(llm)
    llm.generate([list(range(10, 20))], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    # The 10-token prompt: all 10 keys in both layers (its last query sees 4, its first only itself,
    # together all 10); then decodes with 11 and 12 cached tokens: 4 in the sliding layer.
    assert [s.attn_bytes for s in llm.engine.stats.history] == [(10 + 10) * per_layer, (4 + 11) * per_layer,
                                                                 (4 + 12) * per_layer]
    # A prompt chunk of 3 queries at positions 7..9 sees keys 4..9 (6) through the window, a 1-token
    # request with 2 cached tokens its 2, and a 10-token chunk from the start all 10.
    q_len, kv_len = torch.tensor([3, 1, 10]), torch.tensor([10, 2, 10])
    assert llm.engine.runner.attn_read_bytes(q_len, kv_len) == ((6 + 2 + 10) + (10 + 2 + 10)) * per_layer
    # Its KV cache groups: the full layer's and the windowed one's, which releases blocks out of its window.
    llm.generate([list(range(10, 50))], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    r = d.engine_diagnostics(llm.engine)
    assert r["kv_cache"]["group_windows"] == [None, 4] and r["kv_cache"]["released_blocks"] > 0


def test_attention_timing_can_be_turned_off(tiny_llama, monkeypatch):
    from tokenmill import LLM, SamplingParams

    monkeypatch.setenv("TOKENMILL_TIME_ATTENTION", "0")
    llm = LLM(str(tiny_llama), max_model_len=128, num_gpu_blocks_override=32)
    assert llm.engine.runner.attn_timer is None
    assert all(a.timer is None for a in llm.engine.runner.attn_layers)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    steps = list(llm.engine.stats.history)
    assert [s.attn_s for s in steps] == [0.0, 0.0] and all(s.attn_bytes > 0 for s in steps)


def test_diagnostics_route_reports_attention(tiny_llama, tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from tokenmill import LLM, SamplingParams
    from tokenmill.engine.async_engine import AsyncLLMEngine
    from tokenmill.serve.app import build_app
    from tokenmill.serve.metrics import ServerMetrics
    from tokenmill.serve.state import ServerSettings, ServerState

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cal, "measure_peaks", lambda device, dtype: PEAKS)
    llm = LLM(str(tiny_llama), max_model_len=128, num_gpu_blocks_override=32)
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    state = ServerState(AsyncLLMEngine(llm.engine), ServerSettings(["tiny"]), ServerMetrics("tiny"))
    with TestClient(build_app(state)) as client:
        r = client.get("/v1/diagnostics")
    assert r.status_code == 200, r.text
    body = r.json()
    a = body["attention"]
    assert a["timed"] is True and a["bytes"] == (4 + 5 + 6 + 7) * 2 * _kv_bytes_per_token_per_layer(llm)
    assert 0 < a["s_per_step"] and 0 < a["share_of_forward"] <= 1
    assert a["s_per_step"] == pytest.approx(a["time_s"] / body["steps"])
    assert a["bytes_per_s"] == pytest.approx(a["bytes"] / a["time_s"])
    assert a["bandwidth_share_of_peak"] == pytest.approx(a["bytes_per_s"] / PEAKS.bandwidth)


def test_bench_throughput_reports_attention(tiny_llama, tmp_path, monkeypatch, capsys):
    from tokenmill.cli import main

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cal, "measure_peaks", lambda device, dtype: PEAKS)
    out = tmp_path / "out.json"
    rc = main(["bench", "throughput", str(tiny_llama), "--max-model-len", "128", "--num-gpu-blocks-override", "32",
               "--num-prompts", "2", "--input-len", "8", "--output-len", "3", "-q", "--output-json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    line = next(ln for ln in printed.splitlines() if ln.strip().startswith("attention:"))
    assert re.search(r"attention: \d+\.\d{3} ms/step \(\d+% of forward\), .* K/V read/step, "
                     r"\d+\.\d+ GB/s \(\d+% of 10 calibrated\)", line), line
    a = json.loads(out.read_text())["diagnostics"]["attention"]
    assert a["timed"] and a["s_per_step"] > 0 and 0 < a["share_of_forward"] <= 1 and a["bytes"] > 0
    assert a["bandwidth_share_of_peak"] == pytest.approx(a["bytes_per_s"] / PEAKS.bandwidth)


def test_attention_timer_by_device_and_flag(monkeypatch):
    from tokenmill.executor.model_runner import _attention_timer

    monkeypatch.delenv("TOKENMILL_TIME_ATTENTION", raising=False)
    assert _attention_timer(torch.device("cpu")).sync is False  # CPU: on, no device sync
    assert _attention_timer(torch.device("cuda")) is None  # CUDA: off unless asked (it syncs every layer)
    monkeypatch.setenv("TOKENMILL_TIME_ATTENTION", "1")
    assert _attention_timer(torch.device("cuda")).sync is True
    monkeypatch.setenv("TOKENMILL_TIME_ATTENTION", "0")
    assert _attention_timer(torch.device("cpu")) is None


# ---- calibration: re-measured when it cannot be trusted ------------------------------------------
# A peak measured on a busy machine reads low and the report then showed 114-133 % of it. These tests mock
# the load average and (except one) the measurement, so they assert behaviour, never this machine's speed.
def fake_core(steps, busy=False):
    from types import SimpleNamespace

    return SimpleNamespace(stats=SimpleNamespace(history=list(steps)), has_unfinished_requests=lambda: busy,
                           info=SimpleNamespace(device="cpu", compute_dtype="float32", model_cost=COST, weights=None),
                           config=SimpleNamespace(speculative=None, parallel=None), scheduler=None)


# 1000 tokens: ~1.8e11 FLOPs and ~1.01e9 bytes in a 2.5 s forward pass: ~72 GFLOP/s, ~0.4 GB/s achieved.
PREFILL = [step(1000, 1, 2.5)]
ACHIEVED_FLOPS = COST.step_flops(1000, 1, 0) / 2.5
DAY_AGO = 0.0  # measured_at of the stale entries: long past the re-calibration interval


def write_cache(tmp_path, monkeypatch, **entry):
    """A calibration cache in tmp_path holding one entry for this machine's key; returns its file."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    full = {"dtype": "torch.float32", "threads": torch.get_num_threads(), "device": "cpu", "measured_at": DAY_AGO,
            **entry}
    f = tmp_path / "calibration.json"
    f.write_text(json.dumps({cal._key("cpu", torch.float32): full}))
    return f


def cached_entry(f) -> dict:
    return json.loads(f.read_text())[cal._key("cpu", torch.float32)]


def counting_measure(monkeypatch, peaks=PEAKS) -> list:
    calls = []

    def fake(device, dtype):
        calls.append((device, dtype))
        return peaks

    monkeypatch.setattr(cal, "measure_peaks", fake)
    return calls


def quiet(monkeypatch, load: float = 0.0) -> None:
    monkeypatch.setattr(cal, "_load_average", lambda: load, raising=False)


def assert_within_peak(r):
    a = r["achieved"]
    assert a["flops_share_of_peak"] <= 1 + 1e-9 and a["bandwidth_share_of_peak"] <= 1 + 1e-9
    assert (r["attention"]["bandwidth_share_of_peak"] or 0) <= 1 + 1e-9


def test_stale_low_calibration_is_remeasured_for_real(tmp_path, monkeypatch):
    # The cache: written by the old format (no load recorded), absurdly low peaks. The engine beats
    # both, so the report re-measures (really: no mock) instead of showing thousands of percent.
    f = write_cache(tmp_path, monkeypatch, flops=1e9, bandwidth=1e6)
    r = d.engine_diagnostics(fake_core(PREFILL))
    c = r["calibration"]
    assert c["recalibrated"] and c["over_peak"] == ["flops", "bandwidth"]
    e = cached_entry(f)
    assert e["flops"] > 1e9 and e["bandwidth"] > 1e6  # the measurement (or, if it read lower, the achieved figure)
    assert e["measured_at"] > DAY_AGO and e["cpu_count"] == os.cpu_count()
    assert isinstance(e["load_average"], float) and e["load_average"] >= 0  # the load it was measured under
    assert r["peaks"]["flops"] == e["flops"] and c["load_average"] == e["load_average"]
    assert_within_peak(r)


def test_peak_beaten_by_the_engine_is_remeasured(tmp_path, monkeypatch):
    quiet(monkeypatch, 0.25)
    calls = counting_measure(monkeypatch)  # the fresh measurement: 100 GFLOP/s, 10 GB/s
    f = write_cache(tmp_path, monkeypatch, flops=1e9, bandwidth=10e9, load_average=0.0, cpu_count=os.cpu_count())
    r = d.engine_diagnostics(fake_core(PREFILL))
    assert len(calls) == 1
    e = cached_entry(f)
    assert e["flops"] == PEAKS.flops and e["bandwidth"] == PEAKS.bandwidth and e["raised_to_observed"] == []
    assert e["load_average"] == 0.25 and e["cpu_count"] == os.cpu_count() and e["measured_at"] > DAY_AGO
    c = r["calibration"]
    assert c["recalibrated"] and c["over_peak"] == ["flops"] and not c["stale"] and not c["under_load"]
    assert "re-measured because flops achieved" in c["note"]
    assert r["achieved"]["flops_share_of_peak"] == pytest.approx(ACHIEVED_FLOPS / PEAKS.flops)
    assert "calibration: re-measured because" in d.format_report(r)
    # Trusted now: the next report reads the cache without measuring.
    again = d.engine_diagnostics(fake_core(PREFILL))["calibration"]
    assert len(calls) == 1 and not again["recalibrated"] and not again["stale"] and again["note"] == ""


def test_measurement_still_below_the_engine_stores_the_achieved_figure(tmp_path, monkeypatch):
    quiet(monkeypatch)
    low = d.Peaks(flops=2e9, bandwidth=10e9, dtype="float32", threads=2, device="cpu", measured_at=0.0)
    calls = counting_measure(monkeypatch, low)  # the machine is still slow (or busy) as it re-measures
    f = write_cache(tmp_path, monkeypatch, flops=1e9, bandwidth=10e9, load_average=0.0, cpu_count=os.cpu_count())
    r = d.engine_diagnostics(fake_core(PREFILL))
    assert len(calls) == 1
    e = cached_entry(f)
    assert e["flops"] == pytest.approx(ACHIEVED_FLOPS) and e["raised_to_observed"] == ["flops"]
    assert r["achieved"]["flops_share_of_peak"] == pytest.approx(1.0)
    assert r["calibration"]["raised_to_observed"] == ["flops"] and "lower bound" in r["calibration"]["note"]


def test_recalibration_is_rate_limited(tmp_path, monkeypatch):
    quiet(monkeypatch)
    low = d.Peaks(flops=2e9, bandwidth=10e9, dtype="float32", threads=2, device="cpu", measured_at=0.0)
    calls = counting_measure(monkeypatch, low)
    f = write_cache(tmp_path, monkeypatch, flops=1e9, bandwidth=10e9, load_average=0.0, cpu_count=os.cpu_count())
    d.engine_diagnostics(fake_core(PREFILL))
    stored = cached_entry(f)["flops"]
    # The engine beats even the raised figure at once: no second measurement within the interval, and
    # the report divides by what was achieved, flagged, rather than showing more than 100 %.
    faster = [step(1000, 1, 1.0)]
    r = d.engine_diagnostics(fake_core(faster))
    assert len(calls) == 1 and cached_entry(f)["flops"] == stored
    c = r["calibration"]
    assert c["stale"] and c["over_peak"] == ["flops"] and not c["recalibrated"] and "at most every" in c["note"]
    assert_within_peak(r)
    assert "calibration (STALE)" in d.format_report(r)
    monkeypatch.setattr(cal, "RECALIBRATE_INTERVAL_S", 0.0)  # the interval has passed
    r = d.engine_diagnostics(fake_core(faster))
    assert len(calls) == 2 and r["calibration"]["recalibrated"]
    assert cached_entry(f)["flops"] == pytest.approx(COST.step_flops(1000, 1, 0) / 1.0)


def test_busy_engine_defers_the_measurement(tmp_path, monkeypatch):
    quiet(monkeypatch)
    calls = counting_measure(monkeypatch)
    f = write_cache(tmp_path, monkeypatch, flops=1e9, bandwidth=10e9, load_average=0.0, cpu_count=os.cpu_count())
    r = d.engine_diagnostics(fake_core(PREFILL, busy=True))  # requests in flight: not a safe moment
    assert calls == [] and cached_entry(f)["flops"] == 1e9
    c = r["calibration"]
    assert c["stale"] and c["over_peak"] == ["flops"] and "engine is busy" in c["note"]
    assert_within_peak(r)
    r = d.engine_diagnostics(fake_core(PREFILL, busy=False))  # idle: measured now
    assert len(calls) == 1 and r["calibration"]["recalibrated"] and cached_entry(f)["flops"] == PEAKS.flops


def test_calibration_under_load_is_flagged_and_remeasured_when_quiet(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    cpus = os.cpu_count()
    calls = counting_measure(monkeypatch)
    quiet(monkeypatch, 4.0 * cpus)  # other processes keep every core busy four times over
    f = tmp_path / "calibration.json"
    slow = [step(1, 1, 0.150)]  # well within PEAKS: only the load makes the calibration suspect
    r = d.engine_diagnostics(fake_core(slow))
    assert len(calls) == 1 and cached_entry(f)["load_average"] == 4.0 * cpus
    c = r["calibration"]
    assert c["stale"] and c["under_load"] and "may read low" in c["note"] and "(STALE)" in d.format_report(r)
    monkeypatch.setattr(cal, "RECALIBRATE_INTERVAL_S", 0.0)
    assert d.engine_diagnostics(fake_core(slow))["calibration"]["stale"]  # still loaded: measuring now would
    assert len(calls) == 1  # read low again
    quiet(monkeypatch, 0.0)
    r = d.engine_diagnostics(fake_core(slow))
    assert len(calls) == 2 and r["calibration"]["recalibrated"] and not r["calibration"]["stale"]
    assert cached_entry(f)["load_average"] == 0.0


def test_entry_without_a_recorded_load_is_suspect(tmp_path, monkeypatch):
    quiet(monkeypatch)
    calls = counting_measure(monkeypatch)
    f = write_cache(tmp_path, monkeypatch, flops=PEAKS.flops, bandwidth=PEAKS.bandwidth)  # old format
    r = d.engine_diagnostics(fake_core([step(1, 1, 0.150)]))
    assert len(calls) == 1 and r["calibration"]["recalibrated"] and cached_entry(f)["load_average"] == 0.0


def test_own_engine_load_is_not_blamed_on_others(monkeypatch):
    import time

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    now = time.perf_counter()
    # The last minute spent in forward passes (2 threads) ending just now, plus one step from an hour ago.
    steps = [StepStats(forward_s=60.0, num_tokens=1, end_time=now - 3600)]
    steps += [StepStats(forward_s=1.0, num_tokens=1, end_time=now - 60 + i + 1) for i in range(60)]
    load = cal._own_load(fake_core(steps))
    assert 2 * (1 - 2.72 ** -1) * 0.95 < load < 2.0  # like the kernel's average after a minute at 2 threads
    assert cal._own_load(fake_core([])) == 0.0


def test_cpu_load_does_not_make_a_gpu_calibration_suspect():
    gpu = d.Peaks(flops=1e15, bandwidth=4e12, dtype="bfloat16", threads=2, device="cuda:0", measured_at=0.0,
                  load_average=100.0, cpu_count=2)
    assert not gpu.suspect()
    assert d.Peaks(**{**gpu.as_dict(), "device": "cpu"}).suspect()


def test_diagnose_flags_a_share_above_the_peak():
    low = d.Peaks(flops=1e9, bandwidth=10e9, dtype="float32", threads=2, device="cpu", measured_at=0.0,
                  load_average=0.0, cpu_count=2)
    r = d.diagnose(PREFILL, COST, low)
    assert r["achieved"]["flops_share_of_peak"] > 1  # as given: not hidden, but flagged
    assert r["calibration"]["stale"] and r["calibration"]["over_peak"] == ["flops"]
    assert "calibration (STALE): flops achieved above the calibrated peak" in d.format_report(r)


def test_stale_cache_on_a_tiny_engine(tmp_path, monkeypatch):
    from tiny import make_tiny_model
    from tokenmill import LLM, SamplingParams

    quiet(monkeypatch)
    calls = counting_measure(monkeypatch)
    f = write_cache(tmp_path / "cache", monkeypatch, flops=1.0, bandwidth=1.0)  # any engine beats 1 FLOP/s
    llm = LLM(str(make_tiny_model(tmp_path / "m", "llama")), max_model_len=128, num_gpu_blocks_override=32)
    llm.generate([[5, 6, 7, 8]] * 2, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    r = d.engine_diagnostics(llm.engine)
    assert len(calls) == 1 and r["calibration"]["recalibrated"]
    assert r["calibration"]["over_peak"] == ["flops", "bandwidth"]
    assert cached_entry(f)["flops"] == PEAKS.flops and cached_entry(f)["load_average"] == 0.0
    assert_within_peak(r)
    # last_n: the last N steps; 0 or negative: the whole kept history.
    assert d.engine_diagnostics(llm.engine, 2)["steps"] == 2
    assert d.engine_diagnostics(llm.engine, -1)["steps"] == d.engine_diagnostics(llm.engine, 0)["steps"] == r["steps"]
