"""The roofline maths of tokenmill.diagnostics on hand-built steps, and calibration caching."""
from __future__ import annotations

import pytest

from tokenmill import diagnostics as d
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

    monkeypatch.setattr(d, "measure_peaks", fake)
    import torch

    assert d.load_or_measure_peaks("cpu", torch.float32).flops == PEAKS.flops
    assert d.load_or_measure_peaks("cpu", torch.float32).bandwidth == PEAKS.bandwidth
    assert len(calls) == 1 and (tmp_path / "calibration.json").is_file()


def test_engine_report_on_tiny_model(tmp_path, monkeypatch):
    from tiny import make_tiny_model
    from tokenmill import LLM, SamplingParams

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(d, "measure_peaks", lambda device, dtype: PEAKS)
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
    assert "verdict:" in d.format_report(r)


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
