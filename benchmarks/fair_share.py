"""Fair share on a real server, in wall-clock time: a small request's latency while heavy requests run (issue 44).

The issue's two client repros, against one default `tokenmill serve` (the embedded SmolLM2-135M unless a server
argument names a model), measured end to end with httpx:

- alone: a 16-token prompt, `max_tokens` 16, greedy, `ignore_eos` (median of 3, after one warm-up request);
- repro 1: `{"prompt": <~6.1k tokens>, "n": 8, "echo": true, "logprobs": 5, "max_tokens": 1}`; once the server
  runs it, the small request is sent and timed; the heavy request's own completion time too;
- repro 2: 12 concurrent distinct ~7k-token prompts with n=16 and `max_tokens` 8, then the small request the same
  way.

Printed: the CPU model, the load average at start and end (and around each phase), each latency, small-under-load /
small-alone, and the heavy requests' times. Every wait has a deadline (`--deadline`); a request still running at
its deadline is reported as `>= deadline` (a lower bound) and the server is restarted before the next phase, so
one repro's leftovers never weigh on the next. Goal (issue 44): small-under-load within 3x of alone.

    python benchmarks/fair_share.py                                    # the issue's sizes
    python benchmarks/fair_share.py --repro2-prompts 4 --repro2-len 3000   # repro 2 scaled down
    python benchmarks/fair_share.py --server-arg=--scheduling-policy --server-arg=slo --small-slo 500,100
    python benchmarks/fair_share.py --repo /tmp/old_checkout           # another checkout's `python -m tokenmill`

Prompts are random common words, cut to the wanted token count with the server's own /tokenize and /detokenize
(so they are text, as a client sends; the count is within a token or two of the target).
"""
from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _servers  # noqa: E402
from server_harness import LiveServer, start_server as start_live  # noqa: E402
from tokenmill.diagnostics import cpu_name  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be or has had "
         "one not but first new after who they two their also been its she all more other time into some when year "
         "city used would there over only people world house river water music between during under state school "
         "team small large light night early story paper market garden window family question morning animal "
         "number country history system program mountain village teacher picture company problem journey").split()


# ---- the server ----------------------------------------------------------------------------------------------

def start_server(repo: Path, extra: list[str], log_path: Path, timeout: float) -> LiveServer:
    """`python -m tokenmill serve` of the checkout at `repo`, torch's default threads."""
    return start_live(None, log_path, *extra, timeout=timeout, port=_servers.next_port(), one_thread=False,
                      repo=repo)


def log_tail(server: LiveServer, n: int = 3000) -> str:
    return server.log()[-n:]


def gauge(server: LiveServer, name: str) -> float | None:
    """The sum of a metric's samples in /metrics (e.g. tokenmill:num_requests_running), None if absent."""
    try:
        text = httpx.get(server.url("/metrics"), timeout=5).text
    except httpx.HTTPError:
        return None
    vals = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return sum(vals) if vals else None


# ---- prompts -------------------------------------------------------------------------------------------------

def make_prompt(server: LiveServer, tokens: int, seed: int) -> str:
    """Random common words, cut to `tokens` tokens by the server's tokenizer."""
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(tokens + 16))  # a common word is >= 1 token
    ids = httpx.post(server.url("/tokenize"), json={"prompt": text, "add_special_tokens": False},
                     timeout=60).raise_for_status().json()["tokens"]
    return httpx.post(server.url("/detokenize"), json={"tokens": ids[:tokens]},
                      timeout=60).raise_for_status().json()["prompt"]


# ---- requests ------------------------------------------------------------------------------------------------

@dataclass
class Result:
    seconds: float
    ok: bool  # finished with 200 before the deadline
    detail: str = ""
    prompt_tokens: int | None = None

    def fmt(self) -> str:
        if self.ok:
            return f"{self.seconds:.2f} s"
        return f">= {self.seconds:.1f} s ({self.detail})"


def post(server: LiveServer, body: dict, deadline_s: float) -> Result:
    t = time.perf_counter()
    try:
        with httpx.Client(timeout=httpx.Timeout(deadline_s, connect=10)) as c:
            r = c.post(server.url("/v1/completions"), json=body)
        dt = time.perf_counter() - t
        if r.status_code != 200:
            return Result(dt, False, f"HTTP {r.status_code}: {r.text[:300]}")
        usage = r.json().get("usage") or {}
        return Result(dt, True, prompt_tokens=usage.get("prompt_tokens"))
    except httpx.TimeoutException:
        return Result(time.perf_counter() - t, False, "deadline")
    except httpx.HTTPError as e:
        return Result(time.perf_counter() - t, False, f"{type(e).__name__}: {e}")


@dataclass
class Background:
    """Requests sent at once, each on its own thread; `results` in order once joined."""
    threads: list[threading.Thread] = field(default_factory=list)
    results: list[Result | None] = field(default_factory=list)
    sent_at: float = 0.0

    def start(self, server: LiveServer, bodies: list[dict], deadline_s: float) -> None:
        self.results = [None] * len(bodies)

        def one(i: int, body: dict) -> None:
            self.results[i] = post(server, body, deadline_s)

        self.sent_at = time.perf_counter()
        self.threads = [threading.Thread(target=one, args=(i, b), daemon=True) for i, b in enumerate(bodies)]
        for th in self.threads:
            th.start()

    def join(self) -> list[Result]:
        for th in self.threads:
            th.join()
        return self.results  # type: ignore[return-value]


def wait_started(server: LiveServer, bg: Background, lead: float, cap: float) -> str:
    """Until the server runs the heavy work (tokenmill:num_requests_running > 0) and at least `lead` s passed
    since it was sent, or `cap` s passed, or the heavy work is done; says which."""
    seen = None
    while True:
        now = time.perf_counter() - bg.sent_at
        if all(r is not None for r in bg.results):
            return f"heavy work done before the small request was sent ({now:.2f} s)"
        if seen is None and (gauge(server, "tokenmill:num_requests_running") or 0) > 0:
            seen = now
        if seen is not None and now >= lead:
            return f"running seen {seen:.2f} s after sending; small request sent at {now:.2f} s"
        if now >= cap:
            return f"running not seen in {cap:.0f} s; small request sent at {now:.2f} s anyway"
        time.sleep(0.1)


# ---- the run -------------------------------------------------------------------------------------------------

def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def small_body(prompt: str, args) -> dict:
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    if args.small_slo:
        ttft, tpot = (float(x) for x in args.small_slo.split(","))
        body["slo"] = {"ttft_ms": ttft, "tpot_ms": tpot}
    return body


def under_load(name: str, server: LiveServer, heavy: list[dict], args, alone: float, seed: int) -> tuple[dict, bool]:
    """Send `heavy` at once, then the small request once the server runs them; both timed. Returns the figures and
    whether every request finished (else the server should be restarted)."""
    small = small_body(make_prompt(server, args.small_len, seed), args)
    print(f"[{name}] load before: {load()}", flush=True)
    bg = Background()
    bg.start(server, heavy, args.deadline)
    how = wait_started(server, bg, args.lead, args.start_cap)
    small_sent = time.perf_counter() - bg.sent_at
    s = post(server, small, args.deadline)
    heavy_res = bg.join()
    times = [r.seconds for r in heavy_res]
    all_ok = s.ok and all(r.ok for r in heavy_res)
    out = {"how": how, "small": s, "small_sent": small_sent, "heavy": heavy_res, "ratio": s.seconds / alone,
           "heavy_wall": max(times), "load_after": load()}
    print(f"[{name}] {how}", flush=True)
    print(f"[{name}] small under load: {s.fmt()}  ({'>= ' if not s.ok else ''}{out['ratio']:.2f}x alone)",
          flush=True)
    tokens = {r.prompt_tokens for r in heavy_res if r.prompt_tokens}
    ok = sum(r.ok for r in heavy_res)
    print(f"[{name}] heavy: {len(heavy_res)} request(s), {ok} finished, prompt tokens {sorted(tokens) or '?'}; "
          f"times min/median/max {min(times):.1f}/{statistics.median(times):.1f}/{max(times):.1f} s"
          + ("" if ok == len(heavy_res) else f"; not finished: {sorted({r.detail for r in heavy_res if not r.ok})}"),
          flush=True)
    print(f"[{name}] load after: {out['load_after']}", flush=True)
    return out, all_ok


def measure_alone(server: LiveServer, args, name: str, seed: int) -> float:
    runs = []
    for i in range(3):
        r = post(server, small_body(make_prompt(server, args.small_len, seed + i), args), args.deadline)
        if not r.ok:
            raise RuntimeError(f"small request alone failed: {r.detail}\n{log_tail(server)}")
        runs.append(r.seconds)
    med = statistics.median(runs)
    print(f"[{name}] small request: {' / '.join(f'{x:.3f}' for x in runs)} s; median {med:.3f} s (load {load()})",
          flush=True)
    return med


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", type=Path, default=REPO, help="checkout whose `python -m tokenmill` serves")
    p.add_argument("--server-arg", action="append", default=[], help="extra `tokenmill serve` argument (repeat)")
    p.add_argument("--deadline", type=float, default=600.0, help="seconds any one wait may take")
    p.add_argument("--lead", type=float, default=1.0, help="seconds after the heavy work is sent before the small")
    p.add_argument("--start-cap", type=float, default=10.0, help="longest wait for the heavy work to show running")
    p.add_argument("--small-len", type=int, default=16)
    p.add_argument("--small-slo", default="", help="TTFT_MS,TPOT_MS: the small request's `slo` field")
    p.add_argument("--repro1-len", type=int, default=6100)
    p.add_argument("--repro1-n", type=int, default=8)
    p.add_argument("--repro2-prompts", type=int, default=12)
    p.add_argument("--repro2-len", type=int, default=7000)
    p.add_argument("--repro2-n", type=int, default=16)
    p.add_argument("--repro2-max-tokens", type=int, default=8)
    p.add_argument("--skip", choices=["repro1", "repro2"], action="append", default=[])
    p.add_argument("--log-dir", type=Path, default=None, help="where server logs go (default: a temp dir)")
    _servers.add_port_argument(p)
    args = p.parse_args(argv)
    _servers.install(args.port)

    repo = args.repo.resolve()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="fair_share-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    rev = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    load_start = load()
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cores); load average at start: {load_start}")
    print(f"checkout: {repo} @ {rev or '?'}; server args: {args.server_arg or '(default)'}; "
          f"small slo: {args.small_slo or 'none'}; deadline {args.deadline:.0f} s; logs in {log_dir}", flush=True)

    servers = 0

    def fresh() -> LiveServer:
        nonlocal servers
        servers += 1
        return start_server(repo, args.server_arg, log_dir / f"server-{servers}.log", timeout=300)

    server = fresh()
    figures: dict[str, dict] = {}
    try:
        # alone: one warm-up, then the median of 3 (each a prompt of its own, so no prefix-cache hit)
        post(server, small_body(make_prompt(server, args.small_len, 0), args), args.deadline)
        alone = measure_alone(server, args, "alone", 1)
        if "repro1" not in args.skip:
            heavy = [{"prompt": make_prompt(server, args.repro1_len, 100), "n": args.repro1_n, "echo": True,
                      "logprobs": 5, "max_tokens": 1}]
            figures["repro1"], ok = under_load("repro1", server, heavy, args, alone, 10)
            if not ok:
                print("[repro1] a request did not finish: restarting the server", flush=True)
                server.stop()
                server = fresh()

        if "repro2" not in args.skip:
            heavy = [{"prompt": make_prompt(server, args.repro2_len, 200 + i), "n": args.repro2_n,
                      "max_tokens": args.repro2_max_tokens}
                     for i in range(args.repro2_prompts)]
            figures["repro2"], ok = under_load("repro2", server, heavy, args, alone, 20)
            if not ok:
                print("[repro2] a request did not finish: restarting the server", flush=True)
                server.stop()
                server = fresh()
                post(server, small_body(make_prompt(server, args.small_len, 0), args), args.deadline)
        # alone again, on the now idle server: the load on the machine may have moved during the run
        alone_end = measure_alone(server, args, "alone at end", 4)
    finally:
        server.stop()

    print()
    print(f"== fair share, {repo.name} @ {rev or '?'}, server args {' '.join(args.server_arg) or '(default)'}, "
          f"small slo {args.small_slo or 'none'}")
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cores); load average start {load_start}, end {load()}")
    print(f"small alone (median of 3): {alone:.3f} s at start, {alone_end:.3f} s at end")
    shapes = {"repro1": f"1 x {args.repro1_len} tok, n={args.repro1_n}, echo+logprobs 5, max_tokens 1",
              "repro2": f"{args.repro2_prompts} x {args.repro2_len} tok, n={args.repro2_n}, "
                        f"max_tokens {args.repro2_max_tokens}"}
    for name, f in figures.items():
        s = f["small"]
        times = [r.seconds for r in f["heavy"]]
        lb = "" if all(r.ok for r in f["heavy"]) else " (lower bound: not all finished)"
        ge = ">= " if not s.ok else ""
        print(f"{name} [{shapes[name]}]: small {s.fmt()} = {ge}{f['ratio']:.2f}x alone at start, "
              f"{ge}{s.seconds / alone_end:.2f}x alone at end "
              f"(sent {f['small_sent']:.1f} s after the heavy work); heavy done in "
              f"{statistics.median(times):.1f} s median, {max(times):.1f} s last{lb}; load after {f['load_after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
