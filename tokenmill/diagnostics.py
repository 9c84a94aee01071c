"""Where the time goes: per-step timings against this machine's measured peaks (a roofline).

For a window of engine steps we know the time split (schedule, prepare, forward, sample, detokenize,
idle), the tokens processed and the attention work. From the model's shape we know the FLOPs and the
bytes those steps must move at least (weights once per step, the KV cache they read and write). With
the machine's peak FLOP/s and memory bandwidth — measured once by a short calibration and cached —
the minimum time is max(FLOPs / peak, bytes / bandwidth). A run whose busy time is far above that
minimum is overhead-bound (Python, small kernels, inefficient kernels); otherwise it is compute- or
bandwidth-bound, whichever term is larger.

Attention is reported on its own too: the wall time spent inside the attention backend (summed over
layers; timed on CPU, on CUDA only with TOKENMILL_TIME_ATTENTION=1) and the K/V bytes it must read
(attended cache tokens x KV bytes per token, per layer, sliding windows clipped), hence its achieved
bytes/s against the calibrated bandwidth.
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

import torch

CALIBRATION_VERSION = 1
# Below this share of busy time explained by the roofline, the run is called overhead-bound.
ROOFLINE_SHARE_FOR_BOUND = 0.3


@dataclass
class Peaks:
    flops: float  # FLOP/s of a large GEMM in the compute dtype
    bandwidth: float  # bytes/s of a streaming read
    dtype: str
    threads: int
    device: str
    measured_at: float

    def as_dict(self) -> dict:
        return asdict(self)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cache_file() -> Path:
    root = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))
    return root / "calibration.json"


def _key(device: str, dtype: torch.dtype) -> str:
    return f"v{CALIBRATION_VERSION}|{device}|{_cpu_name()}|{os.cpu_count()}|{torch.get_num_threads()}|{torch.__version__}|{dtype}"


def measure_peaks(device: str = "cpu", dtype: torch.dtype = torch.float32, seconds: float = 0.5) -> Peaks:
    """Best of a few timed runs: a square GEMM for FLOP/s, a sum over a large tensor for bandwidth."""
    dev = torch.device(device)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    n = 1024 if dev.type == "cpu" else 8192
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    best = float("inf")
    deadline = time.perf_counter() + seconds
    a @ b
    while True:
        sync()
        t = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() > deadline:
            break
    flops = 2 * n**3 / best
    nbytes = (256 << 20) if dev.type == "cpu" else (2 << 30)
    x = torch.ones(nbytes // 4, device=dev)
    x.sum()
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while True:
        sync()
        t = time.perf_counter()
        x.sum()
        sync()
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() > deadline:
            break
    return Peaks(flops=flops, bandwidth=nbytes / best, dtype=str(dtype), threads=torch.get_num_threads(),
                 device=str(dev), measured_at=time.time())


def load_or_measure_peaks(device: str = "cpu", dtype: torch.dtype = torch.float32) -> Peaks:
    """Calibrate once per machine / thread count / torch version; later starts read the cache."""
    f = _cache_file()
    key = _key(device, dtype)
    try:
        cached = json.loads(f.read_text())
        if key in cached:
            return Peaks(**cached[key])
    except (OSError, ValueError, TypeError):
        cached = {}
    peaks = measure_peaks(device, dtype)
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        cached[key] = peaks.as_dict()
        f.write_text(json.dumps(cached, indent=1))
    except OSError:
        pass
    return peaks


def resident_weight_bytes(model) -> int:
    """Every parameter's bytes as stored: packed quantized weights count their packed size."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


@dataclass
class ModelCost:
    """What one step of this model must compute and move, from its shape."""

    matmul_params: int  # weights used in GEMMs per token (layers + LM head)
    weight_bytes: int  # all weights, read once per step
    kv_bytes_per_token: int  # K and V of one token over all layers
    attn_flops_per_pair: int  # QK^T and PV over all layers for one (query, key) pair
    lm_head_params: int

    @classmethod
    def from_engine(cls, engine) -> "ModelCost":
        return cls.from_model(engine.model, engine.hf_config, engine.runner.kv_dtype)

    @classmethod
    def from_model(cls, model, cfg, kv_dtype) -> "ModelCost":
        from tokenmill.layers.attention import Attention
        from tokenmill.layers.linear import LinearBase

        # GEMM work from each layer's logical shape, not its stored weight (packed quantized weights
        # hold fewer elements than the GEMM multiplies); the LM head is not a LinearBase.
        linear = sum(m.input_size * m.output_size for m in model.modules() if isinstance(m, LinearBase))
        lm_head = cfg.vocab_size * cfg.hidden_size
        matmul = linear + lm_head
        weight_bytes = resident_weight_bytes(model)
        attn = [m for m in model.modules() if isinstance(m, Attention)]
        from tokenmill.layers.attention_backends.kv_quant import block_bytes

        kv_per_token = sum(block_bytes(1, a.num_kv_heads, a.head_dim, kv_dtype) for a in attn)
        attn_flops = sum(4 * a.num_heads * a.head_dim for a in attn)
        return cls(matmul, weight_bytes, kv_per_token, attn_flops, lm_head)

    def step_flops(self, num_tokens: int, num_sampled: int, attn_pairs: int) -> float:
        # The LM head only runs on sampled positions; the rest of the GEMMs on every token.
        body = self.matmul_params - self.lm_head_params
        return 2.0 * (body * num_tokens + self.lm_head_params * num_sampled) + self.attn_flops_per_pair * attn_pairs

    def step_bytes(self, num_tokens: int, kv_tokens: int) -> float:
        return self.weight_bytes + self.kv_bytes_per_token * (kv_tokens + num_tokens)


def diagnose(steps: Iterable, cost: ModelCost, peaks: Peaks, idle_s: float = 0.0) -> dict:
    """Summarise a window of StepStats: the time split, achieved rates, and the verdict."""
    steps = list(steps)
    split = {k: sum(getattr(s, f"{k}_s") for s in steps)
             for k in ("schedule", "offload", "prepare", "forward", "sample", "detokenize")}
    busy = sum(split.values())
    total = busy + idle_s
    flops = sum(cost.step_flops(s.num_tokens, s.num_sampled, s.attn_pairs) for s in steps)
    nbytes = sum(cost.step_bytes(s.num_tokens, s.kv_tokens) for s in steps)
    tokens = sum(s.num_tokens for s in steps)
    forward = split["forward"]
    t_compute = flops / peaks.flops if peaks.flops else 0.0
    t_memory = nbytes / peaks.bandwidth if peaks.bandwidth else 0.0
    roofline = max(t_compute, t_memory)
    if not steps or busy <= 0:
        verdict, reason = "idle", "no steps recorded"
    elif roofline < ROOFLINE_SHARE_FOR_BOUND * busy:
        verdict = "overhead-bound"
        outside = (busy - forward) / busy
        where = ("mostly outside the forward pass (scheduling, KV transfers, input preparation, sampling, "
                 "detokenizing)" if outside > 0.5 else
                 "mostly inside the forward pass: kernels run far below the machine's peaks "
                 "(small GEMMs, per-op overhead, memory-inefficient kernels)")
        reason = (f"compute and memory traffic at peak would explain only {100 * roofline / busy:.0f}% of the busy "
                  f"time; the rest is {where}")
    elif t_compute >= t_memory:
        verdict, reason = "compute-bound", f"FLOPs need {t_compute:.3f} s at peak vs {t_memory:.3f} s for the bytes"
    else:
        verdict, reason = "bandwidth-bound", f"bytes need {t_memory:.3f} s at peak vs {t_compute:.3f} s for the FLOPs"
    return {
        "steps": len(steps),
        "tokens": tokens,
        "time_s": {**split, "idle": idle_s, "busy": busy, "total": total},
        "time_share": {k: (v / total if total else 0.0) for k, v in {**split, "idle": idle_s}.items()},
        "tokens_per_step": tokens / len(steps) if steps else 0.0,
        "achieved": {
            "flops_per_s": flops / forward if forward else 0.0,
            "bytes_per_s": nbytes / forward if forward else 0.0,
            "flops_share_of_peak": (flops / forward) / peaks.flops if forward and peaks.flops else 0.0,
            "bandwidth_share_of_peak": (nbytes / forward) / peaks.bandwidth if forward and peaks.bandwidth else 0.0,
        },
        "roofline": {"compute_s": t_compute, "memory_s": t_memory, "share_of_busy": roofline / busy if busy else 0.0},
        "attention": attention_summary(steps, forward, peaks),
        # Tensor parallelism: time inside all-reduce / all-gather (part of the forward pass; 0 with one rank).
        "collectives": _collectives(steps, forward),
        "peaks": peaks.as_dict(),
        "verdict": verdict,
        "reason": reason,
    }


def _collectives(steps: list, forward_s: float) -> dict:
    spent = sum(getattr(s, "collective_s", 0.0) for s in steps)
    busy = sum(s.busy_s for s in steps)
    return {"time_s": spent, "share_of_forward": spent / forward_s if forward_s else 0.0,
            "share_of_step": spent / busy if busy else 0.0}


def attention_summary(steps: list, forward_s: float, peaks: Peaks) -> dict:
    """Time inside the attention backend (part of the forward pass) and the K/V bytes it had to read,
    against the calibrated bandwidth. Steps that were not timed (CUDA without TOKENMILL_TIME_ATTENTION=1)
    have attn_s 0: then the time-based figures are None, not 0."""
    n = len(steps)
    attn_s = sum(s.attn_s for s in steps)
    attn_bytes = sum(s.attn_bytes for s in steps)
    timed = attn_s > 0
    rate = attn_bytes / attn_s if timed else None
    return {
        "timed": timed,
        "time_s": attn_s if timed else None,
        "s_per_step": attn_s / n if timed and n else None,
        "share_of_forward": attn_s / forward_s if timed and forward_s else None,
        "bytes": attn_bytes,
        "bytes_per_step": attn_bytes / n if n else 0.0,
        "bytes_per_s": rate,
        "bandwidth_share_of_peak": rate / peaks.bandwidth if rate is not None and peaks.bandwidth else None,
        "memory_s_at_peak": attn_bytes / peaks.bandwidth if peaks.bandwidth else 0.0,  # the bytes' minimum time
    }


def engine_diagnostics(core, last_n: int | None = None) -> dict:
    """Diagnose an EngineCore's (or an LLMEngine's) recent steps (all kept history by default)."""
    core = getattr(core, "core", core)
    steps = list(core.stats.history)
    if last_n:
        steps = steps[-last_n:]
    info = core.info
    peaks = load_or_measure_peaks(info.device, getattr(torch, info.compute_dtype))
    # Idle time between the window's steps only: not the wait before its first step (start-up, an
    # earlier quiet spell) nor the one after its last, which belong to no run in the window.
    idle_s = sum(s.idle_before_s for s in steps[1:])
    out = diagnose(steps, info.model_cost, peaks, idle_s=idle_s)
    if core.config.speculative is not None:  # counters since start; acceptance_rate, mean_acceptance_length
        out["speculative"] = {"method": core.config.speculative.method, **core.scheduler.spec_stats.as_dict()}
    return out


def format_report(d: dict) -> str:
    t = d["time_s"]
    lines = [f"where the time went ({d['steps']} steps, {d['tokens']} tokens, {d['tokens_per_step']:.1f} tokens/step):"]
    for k in ("schedule", "offload", "prepare", "forward", "sample", "detokenize", "idle"):
        lines.append(f"  {k:<11} {t[k]:8.3f} s  {100 * d['time_share'][k]:5.1f}%")
    a, p = d["achieved"], d["peaks"]
    lines.append(f"  achieved in forward: {a['flops_per_s'] / 1e9:.1f} GFLOP/s ({100 * a['flops_share_of_peak']:.0f}% of "
                 f"{p['flops'] / 1e9:.0f} peak), {a['bytes_per_s'] / 1e9:.1f} GB/s ({100 * a['bandwidth_share_of_peak']:.0f}% "
                 f"of {p['bandwidth'] / 1e9:.0f} peak)")
    lines.append(format_attention(d["attention"], p["bandwidth"]))
    lines.append(f"  verdict: {d['verdict']} — {d['reason']}")
    return "\n".join(lines)


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def format_attention(a: dict, peak_bandwidth: float) -> str:
    read = f"{_size(a['bytes_per_step'])} K/V read/step"
    if not a["timed"]:
        return f"  attention: not timed ({read}; TOKENMILL_TIME_ATTENTION=1 times it on CUDA, syncing every layer)"
    return (f"  attention: {1e3 * a['s_per_step']:.3f} ms/step ({100 * (a['share_of_forward'] or 0):.0f}% of forward), "
            f"{read}, {a['bytes_per_s'] / 1e9:.2f} GB/s ({100 * (a['bandwidth_share_of_peak'] or 0):.0f}% of "
            f"{peak_bandwidth / 1e9:.0f} calibrated)")
