"""Where the time goes: per-step timings against this machine's measured peaks (a roofline).

For a window of engine steps we know the time split (schedule, prepare, forward, sample, detokenize,
idle), the tokens processed and the attention work. From the model's shape we know the FLOPs and the
bytes those steps must move at least (weights once per step, the KV cache they read and write). With
the machine's peak FLOP/s and memory bandwidth — measured by a short calibration and cached, and
re-measured when the engine beats them or they were measured on a busy machine (see calibrate) —
the minimum time is max(FLOPs / peak, bytes / bandwidth). A run whose busy time is far above that
minimum is overhead-bound (Python, small kernels, inefficient kernels); otherwise it is compute- or
bandwidth-bound, whichever term is larger. With streamed weights (--weights-resident-gb, --cpu-offload-gb) the
forward's waits for their reads are their own share: no kernel ran then, so they are left out of the achieved
rates, and when they dominate the run is disk-bound (or host-link-bound), not overhead-bound.

Attention is reported on its own too: the wall time spent inside the attention backend (summed over
layers; timed on CPU, on CUDA only with TOKENMILL_TIME_ATTENTION=1) and the K/V bytes it must read
(attended cache tokens x KV bytes per token, per layer, sliding windows clipped), hence its achieved
bytes/s against the calibrated bandwidth.
"""
from __future__ import annotations

import json
import math
import os
import platform
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Iterable, Iterator

import torch

CALIBRATION_VERSION = 2  # 2: entries record the load they were measured under
# Below this share of busy time explained by the roofline, the run is called overhead-bound.
ROOFLINE_SHARE_FOR_BOUND = 0.3
# Streamed weights (--weights-resident-gb, --cpu-offload-gb): from this share of the busy time spent waiting for
# their reads, when that wait is also longer than the roofline's minimum, the run is called bound by the stream.
WEIGHT_WAIT_SHARE_FOR_BOUND = 0.3
# The verdict of a run bound by its streamed weights, by the store's source.
STREAM_VERDICTS = {"disk": "disk-bound", "host": "host-link-bound"}
# A stored calibration is re-measured at most this often: never sooner than this after its own
# measured_at (which every process sharing the cache file sees) nor after this process's last attempt.
# Without the limit an engine that keeps beating the calibration would re-measure on every report.
RECALIBRATE_INTERVAL_S = 300.0
# A CPU calibration is suspect when, as it started, other processes kept more than this share of the
# cores busy (the 1-minute load average less this process's own share): the GEMM and the streaming read
# then shared the cores and read low (45 GFLOP/s where the quiet machine gives 96).
LOADED_SHARE_OF_CPUS = 0.5
LOAD_AVERAGE_WINDOW_S = 60.0  # the kernel's 1-minute load average decays with this time constant


@dataclass
class Peaks:
    flops: float  # FLOP/s of a large GEMM in the compute dtype
    bandwidth: float  # bytes/s of a streaming read
    dtype: str
    threads: int
    device: str
    measured_at: float  # time.time() of the measurement
    load_average: float | None = None  # 1-minute os.getloadavg() as the measurement started; None: unknown
    own_load: float = 0.0  # this process's estimated share of that load (its engine's recent steps)
    cpu_count: int | None = None
    # Peaks lifted to a figure the engine achieved because the measurement read lower: lower bounds.
    raised_to_observed: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)

    def others_load(self) -> float | None:
        """The load other processes put on the machine as this was measured."""
        return None if self.load_average is None else max(0.0, self.load_average - self.own_load)

    def suspect(self) -> bool:
        """Measured while other processes kept the cores busy, or under a load nobody recorded. Only a CPU
        measurement shares the cores with that load; a GPU's GEMM and memory read do not."""
        if not self.device.startswith("cpu"):
            return False
        others = self.others_load()
        return others is None or _loaded(others, self.cpu_count)


def _loaded(others_load: float, cpu_count: int | None) -> bool:
    return others_load > LOADED_SHARE_OF_CPUS * (cpu_count or os.cpu_count() or 1)


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):  # not available on this platform
        return None


def cpu_name() -> str:
    """The CPU's model name (quoted with every speed figure: benchmarks print it too)."""
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
    return f"v{CALIBRATION_VERSION}|{device}|{cpu_name()}|{os.cpu_count()}|{torch.get_num_threads()}|{torch.__version__}|{dtype}"


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


# ---- the calibration cache: measured once, re-measured when it cannot be trusted ----------------
# (cache file, key) -> time.time() of this process's last measurement, for RECALIBRATE_INTERVAL_S.
_last_attempt: dict[tuple[str, str], float] = {}


@dataclass
class Calibration:
    """The peaks a report divides by, and how far to trust them (the report's "calibration" section)."""

    peaks: Peaks
    cache_file: Path | None = None
    recalibrated: bool = False  # the peaks were measured during this call
    over_peak: list[str] = field(default_factory=list)  # achieved figures above the stored peaks
    stale: bool = False  # the peaks are not (yet) a trustworthy measurement: `note` says why
    note: str = ""

    def as_dict(self) -> dict:
        p = self.peaks
        return {"cache_file": str(self.cache_file) if self.cache_file else None, "measured_at": p.measured_at,
                "age_s": max(0.0, time.time() - p.measured_at), "load_average": p.load_average,
                "own_load": p.own_load, "cpu_count": p.cpu_count, "under_load": p.suspect(),
                "over_peak": list(self.over_peak), "raised_to_observed": list(p.raised_to_observed),
                "recalibrated": self.recalibrated, "stale": self.stale, "note": self.note}


def _read_cache(f: Path) -> dict:
    try:
        cached = json.loads(f.read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def _entry(cached: dict, key: str) -> Peaks | None:
    raw = cached.get(key)
    if not isinstance(raw, dict):
        return None
    known = {f.name for f in fields(Peaks)}
    try:
        return Peaks(**{k: v for k, v in raw.items() if k in known})
    except TypeError:  # a required field is missing: as good as no entry
        return None


@contextmanager
def _cache_lock(f: Path) -> Iterator[None]:
    """Serialise calibrations of processes sharing the cache file (data-parallel replicas): two measuring at
    once would each take the other's load for the machine's peak."""
    try:
        import fcntl

        f.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f.with_name(f.name + ".lock"), os.O_CREAT | os.O_RDWR, 0o644)
    except (ImportError, OSError):  # no flock here, or an unwritable cache: measure unserialised
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a filesystem without locks: measure unserialised
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


def _store(f: Path, key: str, peaks: Peaks) -> None:
    # Re-read first (another process may have stored other keys) and replace the file whole, so a reader
    # never sees half of it.
    cached = _read_cache(f)
    cached[key] = peaks.as_dict()
    tmp = f.with_name(f"{f.name}.{os.getpid()}.tmp")
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, f)
    except OSError:  # an unwritable cache: the next start measures again
        pass


def _exceeded(p: Peaks, observed: dict[str, float]) -> list[str]:
    return [name for name, value in observed.items() if value > getattr(p, name)]


def _raise_to(p: Peaks, observed: dict[str, float]) -> Peaks:
    """The engine achieved more than the peak: the peak is at least that (a lower bound, marked as such)."""
    over = _exceeded(p, observed)
    if not over:
        return p
    marked = p.raised_to_observed + [n for n in over if n not in p.raised_to_observed]
    return replace(p, **{n: observed[n] for n in over}, raised_to_observed=marked)


def _measure_and_store(device: str, dtype: torch.dtype, f: Path, key: str, own_load: float,
                       observed: dict[str, float], replaces: Peaks | None) -> Peaks:
    """Measure, record the load it was measured under, lift a peak the engine already beat to that figure,
    and store it."""
    _last_attempt[(str(f), key)] = time.time()
    with _cache_lock(f):
        # Another process sharing the cache may have measured while this one waited for the lock.
        current = _entry(_read_cache(f), key)
        if (current is not None and (replaces is None or current.measured_at > replaces.measured_at)
                and not _exceeded(current, observed)):
            return current
        load = _load_average()  # before measuring: the measurement's own threads are not "load" on it
        p = measure_peaks(device, dtype)
        p = replace(p, measured_at=time.time(), load_average=load, own_load=own_load, cpu_count=os.cpu_count(),
                    raised_to_observed=[])
        p = _raise_to(p, observed)
        _store(f, key, p)
    return p


def _ago(t: float) -> str:
    s = max(0.0, time.time() - t)
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago" if s < 7200 else f"{s / 3600:.0f} h ago"


def _load_text(p: Peaks) -> str:
    if p.load_average is None:
        return "under an unrecorded load"
    return f"at load average {p.load_average:.2f} ({p.others_load():.2f} from other processes) on {p.cpu_count} CPUs"


def calibrate(device: str = "cpu", dtype: torch.dtype = torch.float32, *, own_load: float = 0.0,
              may_measure: bool = True, observed: dict[str, float] | None = None) -> Calibration:
    """The calibrated peaks for this device and dtype, re-measured when they cannot be trusted.

    - No entry in the cache: measure now (once per machine / thread count / torch version / dtype).
    - `observed` (the achieved FLOP/s and bytes/s, by Peaks field name) beats the entry: it read low.
      Re-measure whatever the load; if the fresh measurement still reads below what the engine achieved,
      store the achieved figure instead (a lower bound, listed in raised_to_observed).
    - The entry was measured under load (CPU only: other processes' load above LOADED_SHARE_OF_CPUS of the
      cores) or records no load: re-measure once the machine is quiet; until then the report flags it.
    Re-measuring an entry happens only when `may_measure` (the caller's safe moment: the engine has no
    requests) and at most once per RECALIBRATE_INTERVAL_S. Otherwise the peaks returned are
    max(stored, observed), so no figure reads above 100 %, and the result is flagged stale.
    `own_load` is this process's estimated share of the current load average (see _own_load).
    """
    observed = observed or {}
    f, key = _cache_file(), _key(device, dtype)
    stored = _entry(_read_cache(f), key)
    if stored is None:  # nothing to fall back on: measure whatever the moment
        p = _measure_and_store(device, dtype, f, key, own_load, observed, None)
        return _verdict(Calibration(p, f, recalibrated=True), first=True)
    over = _exceeded(stored, observed)
    last = max(stored.measured_at, _last_attempt.get((str(f), key), 0.0))
    due = time.time() - last >= RECALIBRATE_INTERVAL_S
    if over:
        why = " and ".join(f"{n} achieved {observed[n] / getattr(stored, n):.0%} of the stored peak" for n in over)
        wait = ("the engine is busy" if not may_measure else
                f"calibrations run at most every {RECALIBRATE_INTERVAL_S:.0f} s; next in "
                f"{last + RECALIBRATE_INTERVAL_S - time.time():.0f} s")
        if may_measure and due:
            try:
                p = _measure_and_store(device, dtype, f, key, own_load, observed, stored)
                return _verdict(Calibration(p, f, recalibrated=True, over_peak=over), reason=why)
            except (RuntimeError, MemoryError) as e:  # e.g. CUDA out of memory beside the engine's KV cache
                wait = f"re-measuring failed: {type(e).__name__}: {e}"
        return Calibration(_raise_to(stored, observed), f, over_peak=over, stale=True,
                           note=f"{why} (measured {_ago(stored.measured_at)} {_load_text(stored)}): reporting "
                                f"against the achieved figure until re-measured ({wait})")
    if stored.suspect():
        now = _load_average()
        quiet = now is not None and not _loaded(max(0.0, now - own_load), os.cpu_count())
        if quiet and may_measure and due:
            try:
                p = _measure_and_store(device, dtype, f, key, own_load, observed, stored)
                return _verdict(Calibration(p, f, recalibrated=True),
                                reason=f"the previous calibration was measured {_load_text(stored)}")
            except (RuntimeError, MemoryError):  # keep the stored peaks, flagged below; tried again later
                pass
        return Calibration(stored, f, stale=True,
                           note=f"peaks measured {_ago(stored.measured_at)} {_load_text(stored)}: they may read "
                                "low; re-measured once the machine is quiet and the engine idle")
    return _verdict(Calibration(stored, f))


def _verdict(c: Calibration, reason: str = "", first: bool = False) -> Calibration:
    """Stale flag and note for peaks that are now stored as they are."""
    p = c.peaks
    notes = []
    if c.recalibrated:
        notes.append("first calibration for this device, dtype and thread count" if first
                     else f"re-measured because {reason}")
    if p.suspect():
        c.stale = True
        notes.append(f"{'this measurement ran' if c.recalibrated else 'peaks measured'} {_load_text(p)}: they may "
                     "read low; re-measured once the machine is quiet and the engine idle")
    if p.raised_to_observed:
        notes.append(f"{' and '.join(p.raised_to_observed)} peak raised to a figure the engine achieved "
                     "(the measurement read lower): a lower bound, so its share reads up to 100%")
    c.note = "; ".join(notes)
    return c


def load_or_measure_peaks(device: str = "cpu", dtype: torch.dtype = torch.float32) -> Peaks:
    """Calibrate once per machine / thread count / torch version; later starts read the cache (and
    re-measure a calibration taken under load once the machine is quiet; see calibrate)."""
    return calibrate(device, dtype).peaks


def resident_weight_bytes(model) -> int:
    """Every parameter's bytes as stored: packed quantized weights count their packed size. Streamed ones too
    (a step reads them all); `streamed_parameters` names those that are not resident."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def streamed_parameters(model) -> list[torch.nn.Parameter]:
    """The parameters that --weights-resident-gb streams from disk (model/weight_store.py) or --cpu-offload-gb
    keeps in host memory (model/host_offload.py): the start-up log counts them as streamed, not resident."""
    store = getattr(model, "weight_store", None)
    if store is None or not store.streamed:
        return []
    from tokenmill.model.weight_store import _streamable

    layers = list(model.own_layers)
    out = []
    for s in store.streamed:
        # An offloaded layer lists what it moved; a disk-streamed layer maps what could stream (the rest of it,
        # oneDNN-packed or non-contiguous, stayed resident).
        out += getattr(s, "params", None) or [p for p in layers[s.index].parameters() if _streamable(p)]
    return out


def streamed_where(weights: dict) -> str:
    """How the start-up log names a store's streamed bytes, from its describe()."""
    return "streamed from disk per step" if weights["source"] == "disk" else "in host memory, copied per step"


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
    split = {k: sum(getattr(s, f"{k}_s") for s in steps)
             for k in ("schedule", "offload", "prepare", "forward", "sample", "detokenize")}
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
    if last_n and last_n > 0:  # 0, negative or absent: the whole kept history
        steps = steps[-last_n:]
    info = core.info
    # Re-measuring blocks the core for about a second: only at a safe moment, with no request in the
    # engine (then it costs a request that arrives meanwhile that wait, like the first calibration does).
    busy = getattr(core, "has_unfinished_requests", lambda: False)()
    cal = calibrate(info.device, getattr(torch, info.compute_dtype), own_load=_own_load(core), may_measure=not busy,
                    observed=observed_rates(steps, info.model_cost))
    # Idle time between the window's steps only: not the wait before its first step (start-up, an
    # earlier quiet spell) nor the one after its last, which belong to no run in the window.
    idle_s = sum(s.idle_before_s for s in steps[1:])
    weights = getattr(info, "weights", None)
    out = diagnose(steps, info.model_cost, cal.peaks, idle_s=idle_s, weights=weights)
    out["calibration"] = cal.as_dict()
    scheduler = getattr(core, "scheduler", None)  # (the calibration tests pass a core without one)
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


def _own_load(core) -> float:
    """This engine's own share of the 1-minute load average, from its recent steps: the forward pass keeps
    every OpenMP thread of every tensor-parallel rank runnable, the rest of a step one thread; each step
    decays like the kernel's average (e^-age/60 s). Without it, a report right after the engine's own
    traffic would blame that traffic on other processes."""
    parallel = getattr(getattr(core, "config", None), "parallel", None)
    threads = torch.get_num_threads() * (getattr(parallel, "world_size", 1) or 1)
    now = time.perf_counter()
    load = 0.0
    for s in reversed(core.stats.history):
        age = now - s.end_time
        if age > 10 * LOAD_AVERAGE_WINDOW_S:  # older steps no longer show in the average
            break
        load += (s.forward_s * threads + (s.busy_s - s.forward_s)) * math.exp(-max(age, 0.0) / LOAD_AVERAGE_WINDOW_S)
    return load / LOAD_AVERAGE_WINDOW_S


def format_report(d: dict) -> str:
    t = d["time_s"]
    lines = [f"where the time went ({d['steps']} steps, {d['tokens']} tokens, {d['tokens_per_step']:.1f} tokens/step):"]
    for k in ("schedule", "offload", "prepare", "forward", "sample", "detokenize", "idle"):
        lines.append(f"  {k:<11} {t[k]:8.3f} s  {100 * d['time_share'][k]:5.1f}%")
    w = d.get("weight_wait") or {}
    if w.get("time_s"):  # part of forward: its own line, so the kernels are not blamed for it
        lines.append(f"  (of forward, waiting for streamed weights {w['time_s']:.3f} s, "
                     f"{100 * w['share_of_busy']:.1f}% of busy)")
    a, p = d["achieved"], d["peaks"]
    lines.append(f"  achieved in forward: {a['flops_per_s'] / 1e9:.1f} GFLOP/s ({100 * a['flops_share_of_peak']:.0f}% of "
                 f"{p['flops'] / 1e9:.0f} peak), {a['bytes_per_s'] / 1e9:.1f} GB/s ({100 * a['bandwidth_share_of_peak']:.0f}% "
                 f"of {p['bandwidth'] / 1e9:.0f} peak)")
    lines.append(format_attention(d["attention"], p["bandwidth"]))
    c = d.get("calibration") or {}
    if c.get("note"):
        lines.append(f"  calibration{' (STALE)' if c.get('stale') else ''}: {c['note']}")
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
