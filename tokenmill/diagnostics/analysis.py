"""Per-step roofline analysis: what a window of engine steps had to compute and move (ModelCost, from the
model's shape and its resident or streamed weights), what it achieved against the calibrated peaks, and the
verdict (overhead-, compute-, bandwidth-, disk- or host-link-bound) with its reason; engine_diagnostics runs it
over an engine's recent steps.

With the machine's peak FLOP/s and memory bandwidth (calibration.py) the minimum time of the steps is
max(FLOPs / peak, bytes / bandwidth). A run whose busy time is far above that minimum is overhead-bound (Python,
small kernels, inefficient kernels); otherwise it is compute- or bandwidth-bound, whichever term is larger. With
streamed weights (--weights-resident-gb, --cpu-offload-gb) the forward's waits for their reads are their own
share: no kernel ran then, so they are left out of the achieved rates, and when they dominate the run is
disk-bound (or host-link-bound), not overhead-bound.

Attention is reported on its own too: the wall time spent inside the attention backend (summed over layers;
timed on CPU, on CUDA only with TOKENMILL_TIME_ATTENTION=1) and the K/V bytes it must read (attended cache
tokens x KV bytes per token, per layer, sliding windows clipped), hence its achieved bytes/s against the
calibrated bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from tokenmill.diagnostics.calibration import Calibration, Peaks, _exceeded, _own_load, _verdict, calibrate

# Below this share of busy time explained by the roofline, the run is called overhead-bound.
ROOFLINE_SHARE_FOR_BOUND = 0.3
# Streamed weights (--weights-resident-gb, --cpu-offload-gb): from this share of the busy time spent waiting for
# their reads, when that wait is also longer than the roofline's minimum, the run is called bound by the stream.
WEIGHT_WAIT_SHARE_FOR_BOUND = 0.3
# The verdict of a run bound by its streamed weights, by the store's source.
STREAM_VERDICTS = {"disk": "disk-bound", "host": "host-link-bound"}


def resident_weight_bytes(model) -> int:
    """Every parameter's bytes as stored: packed quantized weights count their packed size. Streamed ones too
    (a step reads them all); `streamed_parameters` names those that are not resident."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def streamed_parameters(model) -> list[torch.nn.Parameter]:
    """The parameters that --weights-resident-gb streams from disk (model/weight_store.py) or --cpu-offload-gb
    keeps in host memory (model/host_offload.py): the start-up log counts them as streamed, not resident."""
    store = model.weight_store
    if store is None or not store.streamed:
        return []
    from tokenmill.model.weight_store import _streamable

    layers = list(model.own_layers)
    out = []
    for s in store.streamed:
        # An offloaded layer lists what it moved; a disk-streamed layer maps what could stream (the rest of it,
        # oneDNN-packed or non-contiguous, stayed resident).
        out += s.params or [p for p in layers[s.index].parameters() if _streamable(p)]
    return out



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
        from tokenmill.layers.attention_backends.kv_quant import layer_block_bytes

        kv_per_token = sum(layer_block_bytes(a, 1, kv_dtype) for a in attn)
        attn_flops = sum(4 * a.num_heads * a.head_dim for a in attn)
        return cls(matmul, weight_bytes, kv_per_token, attn_flops, lm_head)

    def step_flops(self, num_tokens: int, num_sampled: int, attn_pairs: int) -> float:
        # The LM head only runs on sampled positions; the rest of the GEMMs on every token.
        body = self.matmul_params - self.lm_head_params
        return 2.0 * (body * num_tokens + self.lm_head_params * num_sampled) + self.attn_flops_per_pair * attn_pairs

    def step_bytes(self, num_tokens: int, kv_tokens: int) -> float:
        return self.weight_bytes + self.kv_bytes_per_token * (kv_tokens + num_tokens)


def observed_rates(steps: list, cost: ModelCost) -> dict[str, float]:
    """What the forward passes achieved, by Peaks field: FLOP/s, and bytes/s (the higher of the whole forward
    pass's and attention's own), the figures a calibrated peak must not fall below."""
    forward = _compute_s(steps)
    attn_s = sum(s.attn_s for s in steps)
    flops = sum(cost.step_flops(s.num_tokens, s.num_sampled, s.attn_pairs) for s in steps)
    nbytes = sum(cost.step_bytes(s.num_tokens, s.kv_tokens) for s in steps)
    attn_rate = sum(s.attn_bytes for s in steps) / attn_s if attn_s > 0 else 0.0
    return {"flops": flops / forward if forward else 0.0,
            "bandwidth": max(nbytes / forward if forward else 0.0, attn_rate)}


def _compute_s(steps: list) -> float:
    """The forward passes' own time: their time less the waits for streamed weights' reads (part of forward_s),
    which no kernel ran in."""
    return sum(s.forward_s - s.weight_wait_s for s in steps)


def diagnose(steps: Iterable, cost: ModelCost, peaks: Peaks, idle_s: float = 0.0, weights: dict | None = None) -> dict:
    """Summarise a window of StepStats: the time split, achieved rates, and the verdict.

    `weights`: the engine's streamed-weights description (WeightStore / HostOffload describe()), if any. The
    forward's waits for their reads are then their own share (`weight_wait`), and when they dominate the verdict
    is `disk-bound` or `host-link-bound`: the kernels did not run while the forward waited.

    The shares of peak are against `peaks` as given; a share above 100 % is flagged in the "calibration"
    section (stale, over_peak), never shown silently. engine_diagnostics passes peaks already re-measured
    or raised (calibrate), so its shares stay within 100 %."""
    steps = list(steps)
    split = {"schedule": sum(s.schedule_s for s in steps), "offload": sum(s.offload_s for s in steps),
             "prepare": sum(s.prepare_s for s in steps), "forward": sum(s.forward_s for s in steps),
             "sample": sum(s.sample_s for s in steps), "detokenize": sum(s.detokenize_s for s in steps)}
    busy = sum(split.values())
    total = busy + idle_s
    flops = sum(cost.step_flops(s.num_tokens, s.num_sampled, s.attn_pairs) for s in steps)
    nbytes = sum(cost.step_bytes(s.num_tokens, s.kv_tokens) for s in steps)
    tokens = sum(s.num_tokens for s in steps)
    wait = sum(s.weight_wait_s for s in steps)
    forward = split["forward"] - wait  # what the kernels had: the achieved rates are over this
    work = busy - wait
    t_compute = flops / peaks.flops if peaks.flops else 0.0
    t_memory = nbytes / peaks.bandwidth if peaks.bandwidth else 0.0
    roofline = max(t_compute, t_memory)
    streamed = bool(weights and weights.get("streamed_bytes_per_step"))
    if not steps or busy <= 0:
        verdict, reason = "idle", "no steps recorded"
    elif streamed and wait >= WEIGHT_WAIT_SHARE_FOR_BOUND * busy and wait >= roofline:
        verdict = STREAM_VERDICTS.get(weights["source"], f"{weights['source']}-bound")
        reason = _stream_reason(weights, len(steps), wait, busy, forward)
    elif roofline < ROOFLINE_SHARE_FOR_BOUND * work:
        verdict = "overhead-bound"
        outside = (work - forward) / work
        where = ("mostly outside the forward pass (scheduling, KV transfers, input preparation, sampling, "
                 "detokenizing)" if outside > 0.5 else
                 "mostly inside the forward pass: kernels run far below the machine's peaks "
                 "(small GEMMs, per-op overhead, memory-inefficient kernels)")
        reason = (f"compute and memory traffic at peak would explain only {100 * roofline / work:.0f}% of the busy "
                  f"time{' less the waits for streamed weights' if wait else ''}; the rest is {where}")
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
        # Streamed weights: the forward's waits for their reads (part of `forward` above; 0 without streaming).
        "weight_wait": {"time_s": wait, "s_per_step": wait / len(steps) if steps else 0.0,
                        "share_of_forward": wait / split["forward"] if split["forward"] else 0.0,
                        "share_of_busy": wait / busy if busy else 0.0},
        "attention": attention_summary(steps, forward, peaks),
        # Tensor parallelism: time inside all-reduce / all-gather (part of the forward pass; 0 with one rank).
        "collectives": _collectives(steps, forward),
        "peaks": peaks.as_dict(),
        "calibration": _calibration_of(peaks, observed_rates(steps, cost)).as_dict(),
        "verdict": verdict,
        "reason": reason,
    }


def _stream_reason(weights: dict, n: int, wait: float, busy: float, compute: float) -> str:
    """Why a run is bound by its streamed weights: the waits, and the step's read bytes against the measured
    read (or copy) speed, so a stream slower than its own measurement shows."""
    MiB = 2**20
    streamed, rate = weights["streamed_bytes_per_step"], weights["read_bytes_per_s"]
    where = "from disk" if weights["source"] == "disk" else "over the host link"
    text = (f"the forward waited for streamed weights {100 * wait / busy:.0f}% of the busy time "
            f"({1e3 * wait / n:.1f} ms a step, against {1e3 * compute / n:.1f} ms of its own compute); each step "
            f"reads {streamed / MiB:.1f} MiB {where}")
    if not rate:
        return text
    read_s = streamed / rate
    text += f", {1e3 * read_s:.1f} ms at the measured {rate / MiB:.0f} MiB/s"
    step = (compute + wait) / n
    if step > 1.3 * max(read_s, compute / n):
        text += (f"; the forward takes {step / max(read_s, compute / n):.1f}x that bound: the reads run at "
                 f"{streamed / step / MiB:.0f} MiB/s or less, below the measured speed")
    return text


def _calibration_of(peaks: Peaks, observed: dict[str, float]) -> Calibration:
    """How far to trust peaks handed to diagnose directly (no cache, no re-measuring)."""
    c = _verdict(Calibration(peaks))
    over = _exceeded(peaks, observed)
    if over:
        c.over_peak, c.stale = over, True
        c.note = "; ".join([f"{' and '.join(over)} achieved above the calibrated peak: the peak reads low and "
                            "the shares above 100 % are not meaningful"] + ([c.note] if c.note else []))
    return c


def _collectives(steps: list, forward_s: float) -> dict:
    spent = sum(s.collective_s for s in steps)
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
    from tokenmill.engine.engine import LLMEngine

    if isinstance(core, LLMEngine):
        core = core.core
    steps = list(core.stats.history)
    if last_n and last_n > 0:  # 0, negative or absent: the whole kept history
        steps = steps[-last_n:]
    info = core.info
    # Re-measuring blocks the core for about a second: only at a safe moment, with no request in the
    # engine (then it costs a request that arrives meanwhile that wait, like the first calibration does).
    busy = core.has_unfinished_requests()
    dtype = getattr(torch, info.compute_dtype)  # getattr: a torch dtype by name ("float32")
    cal = calibrate(info.device, dtype, own_load=_own_load(core), may_measure=not busy,
                    observed=observed_rates(steps, info.model_cost))
    # Idle time between the window's steps only: not the wait before its first step (start-up, an
    # earlier quiet spell) nor the one after its last, which belong to no run in the window.
    idle_s = sum(s.idle_before_s for s in steps[1:])
    weights = info.weights
    out = diagnose(steps, info.model_cost, cal.peaks, idle_s=idle_s, weights=weights)
    out["calibration"] = cal.as_dict()
    scheduler = core.scheduler  # None in the calibration tests' stand-in core
    if scheduler is not None:
        out["scheduling_policy"] = scheduler.policy.describe()  # slo: its step-time fit, shed and made room
        kv = scheduler.kv
        # KV cache groups (docs/long_context.md): each group's window, blocks released out of a window so far
        out["kv_cache"] = {"group_windows": list(kv.group_windows), "num_blocks": kv.num_blocks,
                           "free_blocks": kv.num_free_blocks, "released_blocks": kv.num_released}
    if weights is not None:
        out["weights"] = weight_stream_report(weights, steps)
    if core.config.speculative is not None:  # counters since start; acceptance_rate, mean_acceptance_length
        out["speculative"] = {"method": core.config.speculative.method, **core.scheduler.spec_stats.as_dict()}
    return out


def weight_stream_report(weights: dict, steps: list) -> dict:
    """--weights-resident-gb (model/weight_store.py: from disk) and --cpu-offload-gb (model/host_offload.py: from
    host memory to the device): what each step streams, and which bound sets its speed: the streamed bytes at the
    measured read (or copy) speed against the forward's own compute (its time less the waits for reads), per step
    over the window. `bound` is the source ("disk" or "host") or "compute"."""
    out = dict(weights)
    streamed, rate = weights["streamed_bytes_per_step"], weights["read_bytes_per_s"]
    if not streamed:
        out["bound"] = None
        return out
    n = len(steps)
    read_s = streamed / rate if rate else None
    compute_s = _compute_s(steps) / n if n else None
    wait = sum(s.weight_wait_s for s in steps)
    busy = sum(s.busy_s for s in steps)
    forward = sum(s.forward_s for s in steps)
    out.update(read_s_per_step=read_s, compute_s_per_step=compute_s,
               wait_s_per_step=wait / n if n else None, read_bytes_per_step=streamed,
               wait_share_of_step=wait / busy if busy else None,
               # A step's reads overlap its forward, so took at most its time: they ran at least this fast.
               achieved_read_bytes_per_s=streamed * n / forward if forward else None,
               bound=None if read_s is None or compute_s is None else weights["source"] if read_s > compute_s
               else "compute")
    return out
