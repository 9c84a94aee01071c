"""The machine's peaks a step is measured against: micro-benchmarks of peak FLOP/s and memory bandwidth, the
calibration cache file they are stored in (keyed by machine, thread count, torch version and dtype), its
locking between processes sharing it, and the load rules that decide when a stored calibration is trusted or
re-measured (an engine that beats it, a measurement taken on a busy machine; see calibrate).
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
from typing import Iterator

import torch

CALIBRATION_VERSION = 2  # 2: entries record the load they were measured under
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

    def rate(self, name: str) -> float:
        """The peak an observed rate is held against, by observed_rates' key (flops, bandwidth)."""
        return {"flops": self.flops, "bandwidth": self.bandwidth}[name]

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


def cache_dir() -> Path:
    """$TOKENMILL_CACHE, default ~/.cache/tokenmill: measured facts of this machine (and GGUF tokenizers)."""
    return Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))


def _cache_file() -> Path:
    return cache_dir() / "calibration.json"


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


def read_cache(f: Path) -> dict:
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
def cache_lock(f: Path) -> Iterator[None]:
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


def store_entry(f: Path, key: str, entry: dict) -> None:
    """Stores one entry of a JSON cache file shared by processes (call under cache_lock)."""
    # Re-read first (another process may have stored other keys) and replace the file whole, so a reader
    # never sees half of it.
    cached = read_cache(f)
    cached[key] = entry
    tmp = f.with_name(f"{f.name}.{os.getpid()}.tmp")
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, f)
    except OSError:  # an unwritable cache: the next start measures again
        pass


def _exceeded(p: Peaks, observed: dict[str, float]) -> list[str]:
    return [name for name, value in observed.items() if value > p.rate(name)]


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
    with cache_lock(f):
        # Another process sharing the cache may have measured while this one waited for the lock.
        current = _entry(read_cache(f), key)
        if (current is not None and (replaces is None or current.measured_at > replaces.measured_at)
                and not _exceeded(current, observed)):
            return current
        load = _load_average()  # before measuring: the measurement's own threads are not "load" on it
        p = measure_peaks(device, dtype)
        p = replace(p, measured_at=time.time(), load_average=load, own_load=own_load, cpu_count=os.cpu_count(),
                    raised_to_observed=[])
        p = _raise_to(p, observed)
        store_entry(f, key, p.as_dict())
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
    stored = _entry(read_cache(f), key)
    if stored is None:  # nothing to fall back on: measure whatever the moment
        p = _measure_and_store(device, dtype, f, key, own_load, observed, None)
        return _verdict(Calibration(p, f, recalibrated=True), first=True)
    over = _exceeded(stored, observed)
    last = max(stored.measured_at, _last_attempt.get((str(f), key), 0.0))
    due = time.time() - last >= RECALIBRATE_INTERVAL_S
    if over:
        why = " and ".join(f"{n} achieved {observed[n] / stored.rate(n):.0%} of the stored peak" for n in over)
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


def _own_load(core) -> float:
    """This engine's own share of the 1-minute load average, from its recent steps: the forward pass keeps
    every OpenMP thread of every tensor-parallel rank runnable, the rest of a step one thread; each step
    decays like the kernel's average (e^-age/60 s). Without it, a report right after the engine's own
    traffic would blame that traffic on other processes."""
    parallel = core.config.parallel  # None in the calibration tests' stand-in core
    threads = torch.get_num_threads() * (parallel.world_size if parallel is not None else 1)
    now = time.perf_counter()
    load = 0.0
    for s in reversed(core.stats.history):
        age = now - s.end_time
        if age > 10 * LOAD_AVERAGE_WINDOW_S:  # older steps no longer show in the average
            break
        load += (s.forward_s * threads + (s.busy_s - s.forward_s)) * math.exp(-max(age, 0.0) / LOAD_AVERAGE_WINDOW_S)
    return load / LOAD_AVERAGE_WINDOW_S
