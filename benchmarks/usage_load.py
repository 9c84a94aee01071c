"""What `GET /v1/usage` costs everyone else: a long streamed completion's TPOT (and a small /tokenize's latency,
the work that used to queue behind each read on the tokenizer thread) with no usage reads, and with 20 reads a
second.

A server on the embedded model with --usage-db (pre-filled with a year of rows for 20 tenants x 10 models, so
each read is a real GROUP BY), --admin-key and a keys file of those 20 tenants. Three phases take turns every
--window seconds while the streams run (so the machine's other load, which drifts over minutes on a shared
host, falls on each alike):

- none: no reads;
- admin-20/s: 20 reads a second with the admin key (one caller: past its burst the rate limit answers 429;
  its bucket refills while the other phases run, so a phase serves about READS_PER_S + READ_BURST / window a
  second, more than a steady caller gets);
- tenants-20/s: 20 reads a second spread over the 20 tenants' keys (1 each, within every caller's limit: all
  served, so the reads themselves run).

TPOT of a phase: the time it was on while a stream ran (not counting GUARD_S after each switch) over the
tokens (chunks) that arrived then. Printed: each phase's TPOT and its ratio to `none`, the /tokenize latency,
the reads' latency and status codes, the CPU model and the load average.

    python benchmarks/usage_load.py                       # 4 streams of 1024 tokens, 5 s phases
    python benchmarks/usage_load.py --streams 8 --window 3
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

import _servers  # noqa: E402
from tokenmill.diagnostics import cpu_name  # noqa: E402
from measure import OtherLoad, env_str  # noqa: E402
from server_harness import start_server  # noqa: E402

TENANTS = [f"t{i}" for i in range(20)]
ADMIN = "sk-admin"
STREAMER = "sk-stream"
GUARD_S = 0.1  # after a phase switch, reads of the last phase may still run: gaps and probes there are not counted


def prefill_usage(db: Path, tenants: int = 20, models: int = 10, days: int = 365) -> int:
    """A year of rows, written as the server's store would (its schema: UsageStore creates it), for the
    benchmark's tenants: each of their reads groups a year of its own rows, the admin's all of them."""
    from tokenmill.serve.tenants.usage import UsageStore

    UsageStore(str(db)).close()
    con = sqlite3.connect(db)
    day0 = 86400 * 19700
    rows = [(f"t{t}", f"model-{m}", time.strftime("%Y-%m-%d", time.gmtime(day0 + 86400 * d)), 10, 1000, 100,
             500, 1, 0.001) for t in range(tenants) for m in range(models) for d in range(days)]
    con.executemany("INSERT INTO usage VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    con.commit()
    con.close()
    return len(rows)


class Phases:
    """Which phase is on: they take turns every `window` seconds (none, admin, tenants, none, ...), so the
    machine's other load, which drifts over minutes on a shared host, falls on each phase alike."""

    def __init__(self, names: list[str], window: float) -> None:
        self.names, self.window = names, window
        self.t0 = time.monotonic()

    def at(self, t: float, guard: float = 0.0) -> str | None:
        """The phase at monotonic time t; None within `guard` seconds after a switch (reads still in flight)."""
        k, into = divmod(t - self.t0, self.window)
        return None if into < guard else self.names[int(k) % len(self.names)]


class Reader:
    """GET /v1/usage at `rate` a second with the current phase's keys (none: no reads), until stopped; counts
    the status codes per phase."""

    def __init__(self, url: str, phases: Phases, keys: dict[str, list[str] | None], rate: float) -> None:
        self.url, self.phases, self.keys, self.rate = url, phases, keys, rate
        self.codes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.seconds: dict[str, list[float]] = collections.defaultdict(list)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i, 4), daemon=True) for i in range(4)]

    def _run(self, i: int, n: int) -> None:
        # n threads, each at rate / n, offset: a slow answer delays only its own thread's next read.
        with httpx.Client(timeout=30) as c:
            start = time.monotonic() + i / self.rate
            k = 0
            while not self._stop.is_set():
                due = start + k * n / self.rate
                k += 1
                if self._stop.wait(max(0.0, due - time.monotonic())):
                    return
                phase = self.phases.at(time.monotonic())
                keys = self.keys[phase]
                if keys is None:
                    continue
                key = keys[(k * n + i) % len(keys)]
                t = time.perf_counter()
                try:
                    r = c.get(self.url, params={"group_by": "tenant,model"}, headers={"Authorization": f"Bearer {key}"})
                    self.codes[phase][r.status_code] += 1
                except httpx.HTTPError as e:
                    self.codes[phase][type(e).__name__] += 1
                self.seconds[phase].append(time.perf_counter() - t)

    def __enter__(self) -> "Reader":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)


class TokenizeProbe:
    """A small POST /tokenize every `every` seconds: its latency is the tokenizer thread's queue."""

    def __init__(self, url: str, phases: Phases, every: float = 0.1) -> None:
        self.url, self.phases, self.every = url, phases, every
        self.seconds: dict[str, list[float]] = collections.defaultdict(list)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as c:
            while not self._stop.wait(self.every):
                phase = self.phases.at(time.monotonic(), GUARD_S)
                t = time.perf_counter()
                r = c.post(self.url, json={"prompt": "hello there, how are you?"},
                           headers={"Authorization": f"Bearer {STREAMER}"})
                if r.status_code == 200 and phase is not None:
                    self.seconds[phase].append(time.perf_counter() - t)

    def __enter__(self) -> "TokenizeProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def stream(url: str, tokens: int) -> list[float]:
    """One streamed completion: when each chunk (one token) arrived (monotonic seconds)."""
    body = {"prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}
    arrivals = []
    with httpx.stream("POST", url, json=body, headers={"Authorization": f"Bearer {STREAMER}"}, timeout=600) as s:
        s.raise_for_status()
        for line in s.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                arrivals.append(time.monotonic())
    return arrivals


def by_phase(arrivals: list[float], phases: Phases) -> dict[str, list[float]]:
    """[seconds, tokens] each phase had of a stream after its first token: the time it was on (past GUARD_S after
    each switch) and the tokens that arrived then. Its TPOT is seconds / tokens, so a stall counts wherever it
    falls (averaging only the gaps that begin and end in one phase would drop the long ones)."""
    out: dict[str, list[float]] = {name: [0.0, 0] for name in phases.names}
    first, last = arrivals[0], arrivals[-1]
    k = int((first - phases.t0) // phases.window)
    while phases.t0 + k * phases.window < last:
        lo = max(first, phases.t0 + k * phases.window + GUARD_S)
        hi = min(last, phases.t0 + (k + 1) * phases.window)
        if hi > lo:
            out[phases.names[k % len(phases.names)]][0] += hi - lo
        k += 1
    for t in arrivals[1:]:
        phase = phases.at(t, GUARD_S)
        if phase is not None:
            out[phase][1] += 1
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024, help="each stream's max_tokens (ignore_eos)")
    p.add_argument("--streams", type=int, default=4, help="streams, one after the other")
    p.add_argument("--window", type=float, default=5.0, help="seconds each phase lasts before the next takes over")
    p.add_argument("--rate", type=float, default=20.0, help="/v1/usage reads per second in the loaded phases")
    p.add_argument("--server-args", default="", help="more `tokenmill serve` flags, one string")
    p.add_argument("--json", help="write the figures here")
    _servers.add_port_argument(p)
    args = p.parse_args()
    _servers.install(args.port)

    keys = {"none": None, f"admin-{args.rate:g}/s": [ADMIN],
            f"tenants-{args.rate:g}/s": [f"sk-{t}" for t in TENANTS]}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        db = tmp / "usage.db"
        nrows = prefill_usage(db)
        keys_file = tmp / "keys.json"
        keys_file.write_text(json.dumps({"tenants": [{"name": "stream", "keys": [STREAMER]}]
                                        + [{"name": t, "keys": [f"sk-{t}"]} for t in TENANTS]}))
        env_before = env_str()
        server = start_server(None, tmp / "server.log", "--api-keys-file", str(keys_file), "--admin-key", ADMIN,
                              "--usage-db", str(db), "--max-model-len", "2048", *args.server_args.split(),
                              timeout=300, one_thread=False, port=_servers.next_port())
        other = OtherLoad()
        spent: dict[str, list[float]] = {name: [0.0, 0] for name in keys}  # phase -> [seconds, tokens]
        try:
            for _ in range(2):  # warm-up
                stream(server.url("/v1/completions"), 64)
            phases = Phases(list(keys), args.window)
            with Reader(server.url("/v1/usage"), phases, keys, args.rate) as reader, \
                    TokenizeProbe(server.url("/tokenize"), phases) as probe:
                for i in range(args.streams):
                    for phase, (sec, n) in by_phase(stream(server.url("/v1/completions"), args.tokens),
                                                    phases).items():
                        spent[phase][0] += sec
                        spent[phase][1] += n
                    print(f"  stream {i + 1}/{args.streams}: " + ", ".join(
                        f"{p} {1000 * sec / max(n, 1):.1f} ms ({n})" for p, (sec, n) in spent.items()), flush=True)
        finally:
            server.stop()
        other_cores = other.cores()
    env_after = env_str()

    print(f"\nCPU: {cpu_name()} ({os.cpu_count()} cores); usage db: {nrows} rows; {args.streams} stream(s) of "
          f"{args.tokens} tokens; phases take turns every {args.window:g} s")
    print(f"load before {env_before}, after {env_after}; other processes: "
          f"{'n/a' if other_cores is None else f'{other_cores:.2f} cores'} during the run")
    base = spent["none"][0] / spent["none"][1]
    print(f"{'phase':<18}{'TPOT ms':>9}{'vs none':>9}{'tokens':>7}{'tokenize p50 ms':>17}{'p99':>8}{'read p50 ms':>13}"
          "  reads")
    figures = {}
    for name in keys:
        tpot = spent[name][0] / spent[name][1]
        tok = sorted(probe.seconds[name]) or [float("nan")]
        p99 = tok[min(len(tok) - 1, int(0.99 * len(tok)))]
        read = statistics.median(reader.seconds[name]) * 1000 if reader.seconds[name] else float("nan")
        codes = ", ".join(f"{k}: {v}" for k, v in sorted(reader.codes[name].items(), key=str)) or "-"
        print(f"{name:<18}{1000 * tpot:>9.1f}{tpot / base:>9.3f}{spent[name][1]:>7}"
              f"{1000 * statistics.median(tok):>17.1f}{1000 * p99:>8.1f}{read:>13.1f}  {codes}")
        figures[name] = {"tpot_ms": 1000 * tpot, "ratio": tpot / base, "tokens": spent[name][1],
                         "tokenize_p50_ms": 1000 * statistics.median(tok), "tokenize_p99_ms": 1000 * p99,
                         "read_p50_ms": read, "codes": {str(k): v for k, v in reader.codes[name].items()}}
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "cpu": cpu_name(), "env": [env_before, env_after],
                                               "other_cores": other_cores, "phases": figures}, indent=2))


if __name__ == "__main__":
    main()
