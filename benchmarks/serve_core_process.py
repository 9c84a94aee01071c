"""`tokenmill serve` with the engine core in a thread vs in its own process, side by side in one run.

Starts `python -m tokenmill serve` (the embedded SmolLM2-135M-Instruct) with `--no-engine-core-process`,
runs the workload, stops it, then the same with `--engine-core-process` (with `--rounds N` the pair is
repeated, alternating which mode goes first, so slow drifts in machine load hit both alike).

Workload (the same seeded requests in both modes), at concurrency 16:
- 15 decode lanes, each a closed loop of streaming chat completions: ~100-300 prompt tokens,
  64-128 output tokens, ignore_eos, temperature 0 (20-45 output tok/s in all on a 2-core
  machine: longer answers would not start inside the window, leaving no TTFT samples);
- 1 long-prompt lane: 2,000-token prompts with 16 output tokens, one every --long-period (20) seconds
  while the decodes run (or as soon as the previous one finished, if that took longer).
Measurement window: from the moment every decode lane has streamed its first token (the start-up burst
of 15 prompts is excluded) until the window length has passed and the last long prompt has finished;
then the in-flight decodes are cancelled (the server aborts them). Per mode it reports:
- output tokens/s: content tokens streamed inside the window / window length;
- TTFT P50/P99 of requests sent inside the window, overall and split short/long;
- ITL P50/P99 over every gap between content chunks inside the window, all streams pooled, and the
  same for gaps that do not overlap a long prompt's prefill (its send to its first token), which
  separates the model's own stall (a 2k-token prefill step) from serving overhead;
- from the server's /metrics: steps, time per step phase, core busy share; from /proc: CPU seconds,
  minor page faults and voluntary context switches of the server and the core process; load average.

    python benchmarks/serve_core_process.py                # ~3 minutes on a quiet 2-core machine
    python benchmarks/serve_core_process.py --quick        # ~1-minute smoke run
    python benchmarks/serve_core_process.py --rounds 3 --json out.json

OMP_NUM_THREADS is passed through as you have it (docs/benchmarks.md explains why 1 is the better
setting on a busy 2-core machine).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "benchmarks"))
import _servers  # noqa: E402
from tokenmill.bench.client import (ClientConfig, RequestError, _Stream, _stream_request,  # noqa: E402
                                    build_payload, fetch_text, make_client)
from tokenmill.bench.datasets import BenchRequest, encode, load_tokenizer, make_text  # noqa: E402
from tokenmill.bench.metrics import stats  # noqa: E402
from tokenmill.bench.prometheus import parse_prometheus_text  # noqa: E402

MODES = {"thread": "--no-engine-core-process", "process": "--engine-core-process"}
STEP_PHASES = ("schedule", "offload", "prepare", "forward", "sample", "detokenize")
MODEL_NAME = "SmolLM2-135M-Instruct"


# ---------------------------------------------------------------------------------------------
# The workload: deterministic per lane, generated once and shared by both modes.
# ---------------------------------------------------------------------------------------------
class Workload:
    def __init__(self, tokenizer, args) -> None:
        self.tok, self.args = tokenizer, args
        self._lanes: dict[int, list[BenchRequest]] = {}
        self._rngs = {}
        rng = np.random.default_rng([args.seed, 1_000_000])
        self.long = [self._request(rng, args.long_len, args.long_len, args.long_max_tokens, args.long_max_tokens)
                     for _ in range(args.num_long)]
        wrng = np.random.default_rng([args.seed, 2_000_000])
        self.warmup = [self._request(wrng, 200, 200, 8, 8), self._request(wrng, args.long_len // 4,
                                                                           args.long_len // 4, 4, 4)]

    def _request(self, rng, lo: int, hi: int, out_lo: int, out_hi: int) -> BenchRequest:
        n = int(rng.integers(lo, hi + 1))
        text, got = make_text(rng, n, self.tok)
        return BenchRequest(messages=[{"role": "user", "content": text}], prompt_len=got,
                            output_len=int(rng.integers(out_lo, out_hi + 1)), exact=True)

    def short(self, lane: int, i: int) -> BenchRequest:
        """Lane `lane`'s i-th request: the same in every mode and round (made on first use)."""
        reqs = self._lanes.setdefault(lane, [])
        rng = self._rngs.setdefault(lane, np.random.default_rng([self.args.seed, lane]))
        a = self.args
        while len(reqs) <= i:
            reqs.append(self._request(rng, a.short_len_min, a.short_len_max, a.short_max_tokens_min,
                                      a.short_max_tokens_max))
        return reqs[i]

    def pregenerate(self, lanes: int, per_lane: int) -> None:
        for lane in range(lanes):
            self.short(lane, per_lane - 1)


# ---------------------------------------------------------------------------------------------
# One streamed request, cancellable without losing what it already received.
# ---------------------------------------------------------------------------------------------
@dataclass
class Rec:
    kind: str          # short | long
    lane: int
    start: float       # perf_counter
    stamps: list[float] = field(default_factory=list)  # content chunks, perf_counter
    end: float | None = None
    output_tokens: int | None = None  # usage.completion_tokens, when the stream completed
    prompt_tokens: int | None = None
    error: str | None = None
    cancelled: bool = False

    @property
    def ttft(self) -> float | None:
        return self.stamps[0] - self.start if self.stamps else None

    def tokens_per_chunk(self) -> float:
        if self.output_tokens and self.stamps:
            return self.output_tokens / len(self.stamps)
        return 1.0


@dataclass
class _WatchedStream(_Stream):
    """The bench client's stream state, telling `first` when the first content chunk arrives."""

    first: asyncio.Event | None = None

    def on_event(self, data: str, now: float) -> None:
        super().on_event(data, now)
        if self.first is not None and self.stamps:
            self.first.set()


async def stream_one(client: httpx.AsyncClient, cfg: ClientConfig, req: BenchRequest, rec: Rec,
                     stop: asyncio.Event | None, first: asyncio.Event | None = None) -> Rec:
    """Stream `req` into `rec` until it ends or `stop` is set (then the connection is closed and the
    server aborts the request); never raises."""
    st = _WatchedStream(start=rec.start, first=first)
    task = asyncio.create_task(_stream_request(client, cfg, build_payload(cfg, req), st))
    waiter = asyncio.create_task(stop.wait()) if stop is not None else None
    try:
        await asyncio.wait([task] + ([waiter] if waiter else []), return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            rec.cancelled = True
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        elif task.exception() is not None:
            exc = task.exception()
            st.error = RequestError(type(exc).__name__, str(exc) or repr(exc))
    finally:
        if waiter is not None:
            waiter.cancel()
        rec.end = time.perf_counter()
    rec.stamps = list(st.stamps)
    if st.error is not None:
        rec.error = f"{st.error.key}: {st.error.message}"
    usage = st.usage or {}
    if not rec.cancelled and isinstance(usage.get("completion_tokens"), int):
        rec.output_tokens = usage["completion_tokens"]
        rec.prompt_tokens = usage.get("prompt_tokens")
    return rec


def process_cpu(pid: int) -> dict[str, dict[str, float]]:
    """User and system CPU seconds, minor page faults and voluntary context switches of `pid` ("server")
    and of its engine-core child ("core"), from /proc (Linux); {} elsewhere."""
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def stat(p: int):
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        switches = 0  # voluntary context switches of all its threads: sleeps (locks, OpenMP barriers, I/O)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                for line in Path(f"/proc/{p}/task/{task}/status").read_text().splitlines():
                    if line.startswith("voluntary_ctxt_switches:"):
                        switches += int(line.split()[1])
        except OSError:
            pass
        return int(f[1]), {"user_s": int(f[11]) / hz, "sys_s": int(f[12]) / hz, "minor_faults": int(f[7]),
                           "voluntary_switches": switches}

    out = {}
    me = stat(pid)
    if me is None:
        return out
    out["server"] = me[1]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = stat(int(entry))
            if st is not None and st[0] == pid:
                try:
                    if b"resource_tracker" not in Path(f"/proc/{entry}/cmdline").read_bytes():
                        out["core"] = st[1]
                except OSError:
                    continue
    return out


def _cpu_delta(a: dict, b: dict) -> dict:
    return {k: {f: b[k][f] - a[k][f] for f in b[k]} for k in b if k in a}


async def run_workload(base_url: str, wl: Workload, args, pid: int) -> dict:
    cfg = ClientConfig(base_url=base_url, model=MODEL_NAME, endpoint="chat", ignore_eos=True, temperature=0.0)
    lanes = args.concurrency - 1
    recs: list[Rec] = []
    async with make_client(args.concurrency + 2) as client:
        # Warm-up (excluded): a short and a medium prompt at once.
        warm = await asyncio.gather(*(stream_one(client, cfg, r, Rec("warmup", -1, time.perf_counter()), None)
                                      for r in wl.warmup))
        bad = [r.error for r in warm if r.error]
        if bad:
            raise RuntimeError(f"warm-up failed: {bad[0]}")
        stop = asyncio.Event()
        first_token = [asyncio.Event() for _ in range(lanes)]
        t_start = time.perf_counter()

        async def decode_lane(lane: int) -> None:
            i = 0
            while not stop.is_set():
                rec = Rec("short", lane, time.perf_counter())
                recs.append(rec)
                await stream_one(client, cfg, wl.short(lane, i), rec, stop, first_token[lane])
                i += 1
                if rec.error and not rec.cancelled:
                    print(f"    lane {lane} request failed: {rec.error}", file=sys.stderr)
                    first_token[lane].set()  # do not wait forever for a lane that fails
                    return

        tasks = [asyncio.create_task(decode_lane(lane)) for lane in range(lanes)]
        await asyncio.gather(*(e.wait() for e in first_token))
        t_a = time.perf_counter()
        snap_before = await fetch_text(base_url + "/metrics")
        load_a, cpu_a = os.getloadavg(), process_cpu(pid)
        long_recs: list[Rec] = []
        for k, req in enumerate(wl.long):
            due = t_a + args.long_period * (k + 0.5)
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival schedule, not a measurement
            rec = Rec("long", lanes, time.perf_counter())
            recs.append(rec)
            long_recs.append(rec)
            await stream_one(client, cfg, req, rec, None)
            if rec.error:
                print(f"    long prompt {k} failed: {rec.error}", file=sys.stderr)
        rest = t_a + args.long_period * args.num_long - time.perf_counter()
        if rest > 0:
            await asyncio.sleep(rest)  # the window's fixed length, if the long prompts finished early
        t_b = time.perf_counter()
        load_b, cpu_b = os.getloadavg(), process_cpu(pid)
        snap_after = await fetch_text(base_url + "/metrics")
        stop.set()
        await asyncio.gather(*tasks)
    return dict(recs=recs, t_start=t_start, t_a=t_a, t_b=t_b, metrics_before=snap_before,
                metrics_after=snap_after, load_a=load_a, load_b=load_b,
                cpu=_cpu_delta(cpu_a, cpu_b))


# ---------------------------------------------------------------------------------------------
# Figures of one mode.
# ---------------------------------------------------------------------------------------------
def _phase_deltas(before: str | None, after: str | None) -> dict:
    if not before or not after:
        return {}
    b, a = parse_prometheus_text(before), parse_prometheus_text(after)

    def val(samples, name, **labels):
        want = set(labels.items())
        return sum(s.value for s in samples if s.name == name and want <= set(s.labels))

    out = {"phase_s": {}}
    for p in STEP_PHASES:
        out["phase_s"][p] = val(a, "tokenmill:step_time_seconds_sum", phase=p) - \
            val(b, "tokenmill:step_time_seconds_sum", phase=p)
    out["steps"] = val(a, "tokenmill:iteration_tokens_total_count") - val(b, "tokenmill:iteration_tokens_total_count")
    out["step_tokens"] = val(a, "tokenmill:iteration_tokens_total_sum") - val(b, "tokenmill:iteration_tokens_total_sum")
    out["generation_tokens"] = val(a, "tokenmill:generation_tokens_total") - val(b, "tokenmill:generation_tokens_total")
    out["preemptions"] = val(a, "tokenmill:num_preemptions_total") - val(b, "tokenmill:num_preemptions_total")
    return out


def figures(run: dict) -> dict:
    t_a, t_b = run["t_a"], run["t_b"]
    window = t_b - t_a
    recs: list[Rec] = run["recs"]
    tokens = 0.0
    itl, itl_clean = [], []
    prefills = [(r.start, r.stamps[0] if r.stamps else (r.end or t_b)) for r in recs if r.kind == "long"]
    for r in recs:
        per = r.tokens_per_chunk()
        tokens += per * sum(1 for s in r.stamps if t_a <= s <= t_b)
        for s0, s1 in zip(r.stamps, r.stamps[1:]):
            if t_a <= s0 and s1 <= t_b:
                itl.append(s1 - s0)
                if not any(s0 < p1 and s1 > p0 for p0, p1 in prefills):
                    itl_clean.append(s1 - s0)
    in_window = [r for r in recs if t_a <= r.start <= t_b]
    ttft = {k: [r.ttft for r in in_window if r.ttft is not None and (k == "all" or r.kind == k)]
            for k in ("all", "short", "long")}
    no_token = sum(1 for r in in_window if r.ttft is None)
    errors = [r.error for r in recs if r.error and not r.cancelled]
    chunks_vs_tokens = [(len(r.stamps), r.output_tokens) for r in recs if r.output_tokens]

    def ms(s):
        return asdict(s)

    srv = _phase_deltas(run["metrics_before"], run["metrics_after"])
    if srv:
        busy = sum(srv["phase_s"].values()) - srv["phase_s"]["detokenize"]  # detokenize runs in the API side
        srv["core_busy_share"] = busy / window if window > 0 else None
        srv["mean_step_ms"] = 1000 * busy / srv["steps"] if srv["steps"] else None
    return {
        "window_s": window,
        "ramp_s": t_a - run["t_start"],
        "output_tokens": tokens,
        "output_tok_s": tokens / window if window > 0 else None,
        "requests_started_in_window": {"short": sum(r.kind == "short" for r in in_window),
                                       "long": sum(r.kind == "long" for r in in_window)},
        "requests_without_first_token": no_token,
        "completed": sum(1 for r in recs if r.output_tokens is not None),
        "errors": errors,
        "chunks_fewer_than_tokens": sum(1 for c, t in chunks_vs_tokens if c < t),
        "long_prompt_tokens": [r.prompt_tokens for r in recs if r.kind == "long"],
        "ttft_ms": {k: ms(stats(v)) for k, v in ttft.items()},
        "itl_ms": ms(stats(itl)),
        "itl_outside_long_prefill_ms": ms(stats(itl_clean)),
        # In the window: the server process ("server": the API side in process mode, everything in thread
        # mode) and the engine-core process ("core", process mode only).
        "server_cpu": run["cpu"],
        "load_before": run["load_a"],
        "load_after": run["load_b"],
        "server": srv,
    }


# ---------------------------------------------------------------------------------------------
# The server.
# ---------------------------------------------------------------------------------------------
def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: %.2f, %.2f, %.2f" % os.getloadavg()


class Server:
    def __init__(self, mode: str, args, log_dir: Path) -> None:
        self.port = _servers.next_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"serve-{mode}-{self.port}.log"
        cmd = [sys.executable, "-m", "tokenmill", "serve", "--port", str(self.port), MODES[mode],
               "--max-model-len", str(args.max_model_len), "--kv-cache-memory-bytes", args.kv_cache_memory_bytes,
               "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", *args.server_arg]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   **({"OMP_NUM_THREADS": str(args.omp_threads)} if args.omp_threads else {}),
                   PYTHONPATH=os.pathsep.join([str(REPO)] + ([os.environ["PYTHONPATH"]]
                                                             if os.environ.get("PYTHONPATH") else [])))
        self.cmd = cmd
        self.log = open(self.log_path, "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        deadline = time.monotonic() + args.start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_path.read_text()[-4000:]}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"server not healthy in {args.start_timeout} s:\n{self.log_path.read_text()[-4000:]}")
            time.sleep(0.2)
        self.start_s = time.perf_counter() - t0

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


def run_mode(mode: str, wl: Workload, args, log_dir: Path) -> dict:
    up_before = uptime()
    server = Server(mode, args, log_dir)
    try:
        run = asyncio.run(run_workload(server.base_url, wl, args, server.proc.pid))
    finally:
        rc = server.stop()
    fig = figures(run)
    fig.update(mode=mode, flag=MODES[mode], server_start_s=server.start_s, server_exit_code=rc,
               uptime_before=up_before, uptime_after=uptime(), log=str(server.log_path))
    return fig


# ---------------------------------------------------------------------------------------------
# Report.
# ---------------------------------------------------------------------------------------------
ROWS = [  # label, getter, higher is better
    ("output tok/s", lambda f: f["output_tok_s"], True),
    ("TTFT P50 (ms)", lambda f: f["ttft_ms"]["all"]["median"], False),
    ("TTFT P99 (ms)", lambda f: f["ttft_ms"]["all"]["p99"], False),
    ("  short TTFT P50 (ms)", lambda f: f["ttft_ms"]["short"]["median"], False),
    ("  short TTFT P99 (ms)", lambda f: f["ttft_ms"]["short"]["p99"], False),
    ("  long TTFT P50 (ms)", lambda f: f["ttft_ms"]["long"]["median"], False),
    ("  long TTFT max (ms)", lambda f: f["ttft_ms"]["long"]["max"], False),
    ("ITL P50 (ms)", lambda f: f["itl_ms"]["median"], False),
    ("ITL P90 (ms)", lambda f: f["itl_ms"]["p90"], False),
    ("ITL P99 (ms)", lambda f: f["itl_ms"]["p99"], False),
    ("ITL max (ms)", lambda f: f["itl_ms"]["max"], False),
    ("  ITL P50 outside long prefills", lambda f: f["itl_outside_long_prefill_ms"]["median"], False),
    ("  ITL P99 outside long prefills", lambda f: f["itl_outside_long_prefill_ms"]["p99"], False),
    ("core steps in window", lambda f: (f["server"] or {}).get("steps"), None),
    ("mean step (ms)", lambda f: (f["server"] or {}).get("mean_step_ms"), False),
    ("core busy share of window", lambda f: (f["server"] or {}).get("core_busy_share"), None),
    ("server process CPU user+sys (s)", lambda f: _cpu(f, "server"), None),
    ("core process CPU user+sys (s)", lambda f: _cpu(f, "core"), None),
    ("  of which sys (s), both", lambda f: _both(f, "sys_s"), None),
    ("  minor page faults, both", lambda f: _both(f, "minor_faults"), None),
    ("voluntary context switches, both", lambda f: _both(f, "voluntary_switches"), None),
]


def _cpu(f: dict, proc: str, fields=("user_s", "sys_s")):
    c = f["server_cpu"].get(proc)
    return float(sum(c[x] for x in fields)) if c else None


def _both(f: dict, field: str):
    vals = [_cpu(f, p, (field,)) for p in ("server", "core")]
    return None if all(v is None for v in vals) else sum(v or 0.0 for v in vals)


def ratio(p, t, higher_better):
    """Always 'process is better' when > 1: process/thread for rates, thread/process for latencies."""
    if p is None or t is None or p == 0 or t == 0 or higher_better is None:
        return None
    return p / t if higher_better else t / p


def fmt(x, nd=1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return str(x)
    return f"{x:,.{nd}f}" if isinstance(x, float) else str(x)


def print_round(r: int, res: dict) -> dict:
    t, p = res["thread"], res["process"]
    print(f"\nround {r} (order: {' then '.join(res['order'])})")
    print(f"  {'':34s} {'thread':>12s} {'process':>12s} {'process better by':>18s}")
    ratios = {}
    for label, get, hb in ROWS:
        tv, pv = get(t), get(p)
        rt = ratio(pv, tv, hb)
        ratios[label.strip()] = rt
        nd = 3 if "share" in label else (0 if any(w in label for w in ("steps", "faults", "switches")) else 1)
        print(f"  {label:34s} {fmt(tv, nd):>12s} {fmt(pv, nd):>12s} {fmt(rt, 3) + 'x' if rt else '-':>18s}")
    for m in ("thread", "process"):
        f = res[m]
        print(f"  {m:8s} window {f['window_s']:.1f} s (ramp {f['ramp_s']:.1f} s), {f['output_tokens']:.0f} output tokens, "
              f"started short/long {f['requests_started_in_window']['short']}/{f['requests_started_in_window']['long']}, "
              f"errors {len(f['errors'])}, load {f['load_before'][0]:.2f} -> {f['load_after'][0]:.2f}, "
              f"server ready in {f['server_start_s']:.1f} s")
        srv = f["server"] or {}
        if srv:
            ph = ", ".join(f"{k} {v:.2f}" for k, v in srv["phase_s"].items() if v)
            print(f"           step phases (s): {ph}; {srv['steps']:.0f} steps, {srv['step_tokens']:.0f} tokens")
    print("  (ratios: 'process better by' = process/thread for tok/s, thread/process for latencies; > 1 favours the process)")
    return ratios


def verdict(all_ratios: list[dict], tol: float, itl_margin: float) -> tuple[bool, str]:
    tok = statistics.median(r["output tok/s"] for r in all_ratios if r.get("output tok/s"))
    itl = statistics.median(r["ITL P99 (ms)"] for r in all_ratios if r.get("ITL P99 (ms)"))
    ok_tok, ok_itl = tok >= 1 - tol, itl >= 1 + itl_margin
    itl_word = "improved" if ok_itl else ("worse" if itl <= 1 - itl_margin else f"unchanged within +-{itl_margin:.0%}")
    n = len(all_ratios)
    txt = (f"VERDICT ({'median of ' + str(n) + ' rounds' if n > 1 else '1 round'}): output tok/s process/thread "
           f"{tok:.3f} ({'not slower' if ok_tok else 'SLOWER'}, tolerance {tol:.0%}); ITL P99 thread/process "
           f"{itl:.3f} ({itl_word}) -> issue condition {'HOLDS' if ok_tok and ok_itl else 'DOES NOT HOLD'}")
    return ok_tok and ok_itl, txt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1, help="thread/process pairs, alternating the order (default 1)")
    ap.add_argument("--quick", action="store_true", help="a ~1-minute smoke run (shorter window, 1k-token long prompts)")
    ap.add_argument("--json", metavar="PATH", help="write every figure and setting here")
    ap.add_argument("--concurrency", type=int, default=16, help="decode lanes + 1 long-prompt lane (default 16)")
    ap.add_argument("--short-len-min", type=int, default=100)
    ap.add_argument("--short-len-max", type=int, default=300)
    ap.add_argument("--short-max-tokens-min", type=int, default=64)
    ap.add_argument("--short-max-tokens-max", type=int, default=128)
    ap.add_argument("--long-len", type=int, default=2000, help="long prompt tokens (default 2000)")
    ap.add_argument("--long-max-tokens", type=int, default=16)
    ap.add_argument("--num-long", type=int, default=3, help="long prompts per mode (default 3)")
    ap.add_argument("--long-period", type=float, default=20.0,
                    help="seconds between long-prompt arrivals; the window is num-long x this (default 20)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-memory-bytes", default="1G")
    ap.add_argument("--omp-threads", type=int, default=None,
                    help="set OMP_NUM_THREADS for the servers only (default: leave the environment as it is)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra argument for `tokenmill serve` (repeatable), e.g. --server-arg=--max-num-batched-tokens=512")
    ap.add_argument("--tolerance", type=float, default=0.03, help="tok/s noise allowed for 'not slower' (default 0.03)")
    ap.add_argument("--itl-margin", type=float, default=0.05,
                    help="ITL P99 counts as improved when thread/process >= 1 + this (default 0.05)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--log-dir", default=None, help="server logs (default: a temp folder)")
    _servers.add_port_argument(ap)
    args = ap.parse_args()
    _servers.install(args.port)
    if args.quick:
        args.long_len, args.num_long, args.long_period = min(args.long_len, 1000), 2, 6.0
        args.short_len_max, args.short_max_tokens_min, args.short_max_tokens_max = 200, 32, 48
    if args.concurrency < 2:
        ap.error("--concurrency must be at least 2 (decode lanes + the long-prompt lane)")

    from tokenmill.model.default import default_model_path

    tok = load_tokenizer(default_model_path())
    t0 = time.perf_counter()
    wl = Workload(tok, args)
    wl.pregenerate(args.concurrency - 1, 6)
    long_lens = [len(encode(tok, r.messages[0]["content"])) for r in wl.long]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="serve_core_process-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    print(f"workload: concurrency {args.concurrency} = {args.concurrency - 1} decode lanes "
          f"({args.short_len_min}-{args.short_len_max} prompt tokens, {args.short_max_tokens_min}-"
          f"{args.short_max_tokens_max} output, ignore_eos, greedy) + 1 long-prompt lane ({args.num_long} prompts of "
          f"{min(long_lens)}-{max(long_lens)} tokens, {args.long_max_tokens} output, one every {args.long_period:g} s); "
          f"window {args.num_long * args.long_period:g} s; prompts made in {time.perf_counter() - t0:.1f} s")
    omp = str(args.omp_threads) if args.omp_threads else os.environ.get("OMP_NUM_THREADS", "(unset: torch's default)")
    print(f"servers' OMP_NUM_THREADS={omp}, {os.cpu_count()} CPUs, logs in {log_dir}")
    print(f"uptime: {uptime()}")
    rounds, all_ratios = [], []
    for r in range(args.rounds):
        order = ("thread", "process") if r % 2 == 0 else ("process", "thread")
        res: dict = {"order": list(order)}
        for mode in order:
            t = time.perf_counter()
            res[mode] = run_mode(mode, wl, args, log_dir)
            f = res[mode]
            print(f"  round {r} {mode:7s}: {f['output_tok_s']:.1f} tok/s, TTFT P50 {fmt(f['ttft_ms']['all']['median'])} ms, "
                  f"ITL P99 {fmt(f['itl_ms']['p99'])} ms ({time.perf_counter() - t:.0f} s incl. start/stop; "
                  f"{f['uptime_after']})")
        rounds.append(res)
        all_ratios.append(print_round(r, res))
    if args.rounds > 1:
        print("\nratios per round (> 1 favours the process):")
        for label in ("output tok/s", "TTFT P50 (ms)", "TTFT P99 (ms)", "ITL P99 (ms)", "ITL P99 outside long prefills"):
            vals = [x[label] for x in all_ratios if x.get(label)]
            print(f"  {label:32s} " + "  ".join(f"{v:.3f}" for v in vals) +
                  (f"   median {statistics.median(vals):.3f}" if vals else ""))
    ok, text = verdict(all_ratios, args.tolerance, args.itl_margin)
    print("\n" + text)
    print(f"uptime: {uptime()}")
    if args.json:
        out = {"started_at": started, "args": vars(args), "omp_num_threads": args.omp_threads or os.environ.get("OMP_NUM_THREADS"),
               "cpus": os.cpu_count(), "rounds": rounds, "ratios": all_ratios, "verdict": text, "holds": ok}
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
