"""Soak: N minutes at saturation with mixed streaming/non-streaming requests, aborts and hostile requests.

`--concurrency` workers loop until the time is up, each request's kind drawn at random (weights in KINDS;
every hostile kind is sent once first). Hostile requests should be rejected with a 4xx. With `--faults`, our own
server raises at random stages of the engine step (tokenmill/testing/faults.py); the requests that hit a fault
must fail alone with a clean error (counted as `fault`), never take others down. A request is *lost*
if it got no HTTP response (transport error, or no answer within --request-timeout), a 5xx, or a stream
(not aborted by us) that did not end with `data: [DONE]`. Lost must be 0: the exit code is 1 otherwise.
Printed every minute and at the end: requests, ok / 4xx / 5xx / dropped (no complete response) / lost
(5xx + dropped), generated tokens/s (client, from `usage` or stream chunks; and the server's counter),
server RSS (process + children), peak KV usage and mean running/waiting from /metrics (sampled every 5 s);
then errors and hostile requests by (kind, status, error code), RSS first vs last minute, and whether KV
usage returns to 0 once the load stops (exit code 1 too if not).

    python benchmarks/soak.py --tiny --minutes 1 --concurrency 8     # tiny random llama, smoke run
    python benchmarks/soak.py --minutes 10 --faults default          # with injected faults
    python benchmarks/soak.py --minutes 30                           # embedded SmolLM2-135M
    python benchmarks/soak.py --url http://host:8000 --api-key KEY --server-pid 1234
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import shlex
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))
import _servers  # noqa: E402

HOSTILE = ["top-k-2^63", "10k-stop-strings", "n128-logprobs20", "tokenize-1MB-no-key", "malformed-json",
           "negative-max-tokens", "unknown-model", "prompt-over-context",
           # issue 24's campaign
           "grammar-3000-rules", "logit-bias-vocab-n16", "stop-token-ids-560k", "echo-logprobs-n16",
           "surrogate-model", "n-as-string", "prompt-list-150-bias"]
KINDS = {"completion": 24, "stream-completion": 24, "stream-chat": 20, "chat": 14, "stream-abort": 8,
         **{k: 1 for k in HOSTILE}}  # weights
WORDS = "the a model server token stream batch cache page block prompt answer fast slow river stone light".split()
SERVE_ARGS = "--max-model-len 2048 --kv-cache-memory-bytes 1G"
TINY_SERVE_ARGS = "--max-model-len 512 --kv-cache-memory-bytes 32M"
# Each stage fails for about one request step in a few hundred (per request and step where the stage runs).
DEFAULT_FAULTS = ",".join(f"{stage}=*@0.002" for stage in
                          ("schedule", "transfer", "build_batch", "bitmask", "forward", "sample", "update", "output"))
GAUGES = {"kv": "tokenmill:kv_cache_usage_perc", "running": "tokenmill:num_requests_running",
          "waiting": "tokenmill:num_requests_waiting", "gen": "tokenmill:generation_tokens_total"}


@dataclass
class Spec:
    path: str
    body: dict | None = None
    content: bytes | None = None  # sent as is (malformed JSON)
    stream: bool = False
    abort_after: int = 0  # close the stream after this many events
    auth: bool = True


@dataclass
class Result:
    kind: str
    status: int | None  # None: no HTTP response
    code: str = ""
    tokens: int = 0
    lost: bool = False

    @property
    def outcome(self) -> str:
        if self.code == INJECTED:
            return "injected"
        if self.code.startswith("stream-error"):  # an error event inside a 200 stream
            return "5xx" if self.lost else "4xx"
        if self.status is None or (self.lost and self.status < 500):
            return "dropped"
        return "5xx" if self.status >= 500 else "4xx" if self.status >= 400 else "ok"


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    tokens: int = 0

    def add(self, r: Result) -> None:
        self.outcomes[r.outcome] += 1
        self.tokens += r.tokens


@dataclass
class Target:
    url: str
    api_key: str | None
    model: str
    max_model_len: int
    pid: int | None

    def headers(self, auth: bool = True) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if auth and self.api_key else {}


def text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


@cache
def chained_grammar(n: int) -> str:
    """issue 24: a Lark grammar of n chained rules (88.6 KB at 3,000) that crashed llguidance in-process."""
    rules = ["start: r0"] + [f'r{i}: "x{i}" r{i + 1} | "y{i}"' for i in range(n - 1)] + [f'r{n - 1}: "z"']
    return "\n".join(rules)


@cache
def big_stop_list() -> tuple[str, ...]:
    return tuple(f"{i:06d}" + "x" * 294 for i in range(10_000))


def build(kind: str, rng: random.Random, t: Target) -> Spec:
    base = {"model": t.model, "max_tokens": rng.randint(8, 48), "temperature": 0.8, "seed": rng.randrange(1 << 30)}
    chat = dict(base, messages=[{"role": "user", "content": text(rng, 4, 40)}])
    comp = dict(base, prompt=text(rng, 8, 64))
    usage = {"stream_options": {"include_usage": True}}
    match kind:
        case "completion": return Spec("/v1/completions", comp)
        case "chat": return Spec("/v1/chat/completions", chat)
        case "stream-completion": return Spec("/v1/completions", dict(comp, stream=True, **usage), stream=True)
        case "stream-chat": return Spec("/v1/chat/completions", dict(chat, stream=True, **usage), stream=True)
        case "stream-abort":
            return Spec("/v1/completions", dict(comp, stream=True, max_tokens=64, ignore_eos=True), stream=True,
                        abort_after=rng.randint(1, 6))
        case "top-k-2^63": return Spec("/v1/completions", dict(comp, top_k=9223372036854775808))
        case "10k-stop-strings": return Spec("/v1/completions", dict(comp, stop=list(big_stop_list())))
        case "n128-logprobs20": return Spec("/v1/completions", dict(comp, n=128, max_tokens=160, logprobs=20))
        case "tokenize-1MB-no-key":
            return Spec("/tokenize", {"model": t.model, "prompt": "hello world " * 87_382}, auth=False)
        case "malformed-json": return Spec("/v1/completions", content=b'{"model": "m", "prompt": "hi", "max_tok')
        case "negative-max-tokens": return Spec("/v1/completions", dict(comp, max_tokens=-5))
        case "unknown-model": return Spec("/v1/completions", dict(comp, model="no-such-model"))
        case "prompt-over-context":
            ids = [rng.randrange(10, 300) for _ in range(t.max_model_len + 16)]
            return Spec("/v1/completions", dict(comp, prompt=ids))
        case "grammar-3000-rules":
            return Spec("/v1/completions", dict(comp, guided_grammar=chained_grammar(3000)))
        case "logit-bias-vocab-n16":
            return Spec("/v1/completions", dict(comp, n=16, logit_bias={str(i): 0.5 for i in range(49_152)}))
        case "stop-token-ids-560k":
            return Spec("/v1/completions", dict(comp, n=16, min_tokens=8, stop_token_ids=list(range(560_000))))
        case "echo-logprobs-n16":
            ids = [rng.randrange(10, 300) for _ in range(t.max_model_len - 8)]
            return Spec("/v1/completions", dict(comp, prompt=ids, echo=True, logprobs=20, n=16, max_tokens=4))
        case "surrogate-model":
            return Spec("/v1/completions", content=b'{"model": "\\ud800", "prompt": "hi", "max_tokens": 4}')
        case "n-as-string": return Spec("/v1/completions", dict(comp, n="2"))
        case "prompt-list-150-bias":
            return Spec("/v1/completions", dict(comp, prompt=[text(rng, 4, 8) for _ in range(150)],
                                                logit_bias={str(i): 0.5 for i in range(49_152)}))
    raise ValueError(kind)


INJECTED = "injected-fault"  # an error caused by --faults (TOKENMILL_FAULTS): expected, not lost


def error_code(r: httpx.Response) -> str:
    try:
        e = r.json()["error"]
        assert {"message", "type", "param", "code"} <= e.keys()
        return INJECTED if "injected fault" in str(e["message"]) else str(e["code"] or e["type"])
    except Exception:
        return "not-openai-error-shape"


async def send(client: httpx.AsyncClient, kind: str, spec: Spec, t: Target) -> Result:
    req = client.build_request("POST", t.url + spec.path, json=spec.body, content=spec.content,
                               headers={"Content-Type": "application/json", **t.headers(spec.auth)})
    r = await client.send(req, stream=spec.stream)
    try:
        if r.status_code != 200:
            await r.aread()
            code = error_code(r)
            return Result(kind, r.status_code, code, lost=r.status_code >= 500 and code != INJECTED)
        if not spec.stream:
            usage = r.json().get("usage") or {}
            return Result(kind, 200, "", usage.get("completion_tokens", 0))
        return await read_stream(kind, spec, r)
    finally:
        await r.aclose()


async def read_stream(kind: str, spec: Spec, r: httpx.Response) -> Result:
    events = chunks = 0
    usage, error = None, None
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            if error is not None:
                if "injected fault" in str(error.get("message")):
                    return Result(kind, 200, INJECTED)
                return Result(kind, 200, f"stream-error:{error.get('code') or error.get('type')}",
                              lost=error.get("type") == "server_error")
            return Result(kind, 200, "", usage if usage is not None else chunks)
        obj = json.loads(line[6:])
        if "error" in obj:
            error = obj["error"]
            continue
        if obj.get("usage"):
            usage = obj["usage"]["completion_tokens"]
        chunks += sum(bool(c.get("text") or (c.get("delta") or {}).get("content")) for c in obj["choices"])
        events += 1
        if spec.abort_after and events >= spec.abort_after:
            return Result(kind, 200, "aborted", chunks)
    return Result(kind, 200, "no [DONE]", chunks, lost=True)


async def one(client: httpx.AsyncClient, kind: str, spec: Spec, t: Target, timeout: float) -> Result:
    try:
        return await asyncio.wait_for(send(client, kind, spec, t), timeout)
    except asyncio.TimeoutError:
        return Result(kind, None, f"timeout>{timeout:g}s", lost=True)
    except httpx.HTTPError as e:
        return Result(kind, None, type(e).__name__, lost=True)
    except (ValueError, KeyError, TypeError) as e:  # a 200 whose body is not what the API promises
        return Result(kind, 200, f"bad body: {type(e).__name__}", lost=True)


def tree_rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration):
            pass  # gone, or a zombie without VmRSS
    return total / 1024


async def gauges(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    try:
        lines = (await client.get(url + "/metrics", timeout=30)).text.splitlines()
    except httpx.HTTPError:
        return {}
    out = {}
    for key, name in GAUGES.items():
        vals = [float(ln.split()[-1]) for ln in lines if ln.split("{")[0].split(" ")[0] == name]
        if vals:
            out[key] = sum(vals)
    return out


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


class Soak:
    def __init__(self, t: Target, args) -> None:
        self.t, self.args = t, args
        self.rng = random.Random(args.seed)
        self.kinds = {k: w for k, w in KINDS.items() if k not in args.skip}
        self.hostile = [k for k in HOSTILE if k in self.kinds]
        self.deck = self.rng.sample(self.hostile, len(self.hostile))  # every hostile kind once, first
        self.total, self.minute = Tally(), Tally()
        self.errors: Counter = Counter()
        self.rss: list[float] = []
        self.samples: list[dict[str, float]] = []
        self.last_gen: float | None = None

    def pick(self) -> str:
        return self.deck.pop() if self.deck else self.rng.choices(list(self.kinds), list(self.kinds.values()))[0]

    async def worker(self, client: httpx.AsyncClient, deadline: float) -> None:
        while time.monotonic() < deadline:
            kind = self.pick()
            r = await one(client, kind, build(kind, self.rng, self.t), self.t, self.args.request_timeout)
            self.total.add(r)
            self.minute.add(r)
            if r.outcome != "ok" or r.kind in HOSTILE:
                self.errors[(r.kind, r.status, r.code)] += 1

    async def report(self, client: httpx.AsyncClient, label: str, seconds: float) -> None:
        """One line for the interval: KV usage is its peak, running/waiting their means over the 5-s samples."""
        m, self.minute = self.minute, Tally()
        g, rss = await gauges(client, self.t.url), tree_rss_mib(self.t.pid)
        samples, self.samples = [x for x in self.samples + [g] if "kv" in x], []
        server_tps = None
        if "gen" in g and self.last_gen is not None:
            server_tps = (g["gen"] - self.last_gen) / seconds
        self.last_gen = g.get("gen", self.last_gen)
        if rss is not None:
            self.rss.append(rss)

        def mean(key: str) -> float | None:
            return sum(x[key] for x in samples) / len(samples) if samples else None

        o = m.outcomes
        lost = o["5xx"] + o["dropped"]
        kv = max(x["kv"] for x in samples) if samples else None
        print(f"{label:>6} {sum(o.values()):6d} {o['ok']:5d} {o['4xx']:5d} {o['injected']:5d} {o['5xx']:5d} "
              f"{o['dropped']:7d} {lost:5d} "
              f"{m.tokens / seconds:8.1f} {fmt(server_tps, '9.1f'):>9} {fmt(rss, '8.0f'):>8} {fmt(kv, '7.1%'):>7} "
              f"{fmt(mean('running'), '5.1f'):>5} {fmt(mean('waiting'), '5.1f'):>5}", flush=True)

    async def reporter(self, client: httpx.AsyncClient) -> None:
        for minute in range(1, 1 << 30):
            while (left := self.mark + 60 - time.monotonic()) > 0:
                await asyncio.sleep(min(5.0, left))
                if left > 5:
                    self.samples.append(await gauges(client, self.t.url))
            seconds, self.mark = time.monotonic() - self.mark, time.monotonic()
            await self.report(client, str(minute), seconds)

    async def run(self) -> int:
        limits = httpx.Limits(max_connections=self.args.concurrency + 4)
        async with httpx.AsyncClient(timeout=self.args.request_timeout, limits=limits) as client:
            self.last_gen = (await gauges(client, self.t.url)).get("gen")
            print(f"{'minute':>6} {'reqs':>6} {'ok':>5} {'4xx':>5} {'fault':>5} {'5xx':>5} {'dropped':>7} {'lost':>5} "
                  f"{'tok/s':>8} "
                  f"{'srv tok/s':>9} {'RSS MiB':>8} {'KV max':>7} {'run':>5} {'wait':>5}", flush=True)
            start = self.mark = time.monotonic()
            reporter = asyncio.create_task(self.reporter(client))
            await asyncio.gather(*(self.worker(client, start + 60 * self.args.minutes)
                                   for _ in range(self.args.concurrency)))
            reporter.cancel()
            await self.report(client, "end", max(time.monotonic() - self.mark, 1e-3))
            wall = time.monotonic() - start
            kv, drained = await self.drain(client)
        return self.summary(wall, kv, drained)

    async def drain(self, client: httpx.AsyncClient, within: float = 10.0) -> tuple[float | None, float]:
        t0 = time.monotonic()
        while True:
            g = await gauges(client, self.t.url)
            done = g.get("kv") == 0 and g.get("running") == 0 and g.get("waiting") == 0
            if done or time.monotonic() - t0 > within:
                return g.get("kv"), time.monotonic() - t0
            await asyncio.sleep(0.25)

    def summary(self, wall: float, kv: float | None, drained: float) -> int:
        o = self.total.outcomes
        lost = o["5xx"] + o["dropped"]
        print(f"\ntotal: {sum(o.values())} requests in {wall:.0f} s, ok {o['ok']}, rejected 4xx {o['4xx']}, "
              f"failed by an injected fault {o['injected']}, 5xx "
              f"{o['5xx']}, dropped (no complete response) {o['dropped']}; LOST {lost}; "
              f"{self.total.tokens / wall:.1f} tok/s")
        print("errors and hostile requests by (kind, status, code):")
        for (kind, status, code), n in sorted(self.errors.items(), key=lambda x: (x[0][0], str(x[0][1:]))):
            flag = "  <- hostile, expected 4xx" if kind in HOSTILE and not (status and 400 <= status < 500) else ""
            print(f"  {kind:<22} {str(status):>4} {code:<32} {n:6d}{flag}")
        accepted = sorted({k for (k, s, _c) in self.errors if k in HOSTILE and not (s and 400 <= s < 500)})
        print(f"hostile kinds always rejected as expected (4xx): {sorted(set(self.hostile) - set(accepted))}")
        print(f"hostile kinds NOT rejected with a 4xx: {accepted or 'none'}")
        if self.rss:
            print(f"server RSS: first minute {self.rss[0]:.0f} MiB, last {self.rss[-1]:.0f} MiB "
                  f"({self.rss[-1] - self.rss[0]:+.0f} MiB)")
        kv_ok = kv == 0
        print(f"KV usage after the load: {fmt(kv, '.1%')} after {drained:.1f} s "
              f"({'back to 0' if kv_ok else 'NOT back to 0'})")
        print("PASS" if lost == 0 and kv_ok else "FAIL: " + ", ".join(
            (["lost requests"] if lost else []) + (["KV not released"] if not kv_ok else [])))
        return 0 if lost == 0 and kv_ok else 1


async def target_info(url: str, api_key: str | None, pid: int | None) -> Target:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30) as client:
        card = (await client.get(url + "/v1/models", headers=headers)).raise_for_status().json()["data"][0]
    return Target(url, api_key, card["id"], card.get("max_model_len") or 2048, pid)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="an existing server (default: start `tokenmill serve` on a free port)")
    p.add_argument("--api-key", help="with --url: the server's key (our own server gets a random one)")
    p.add_argument("--server-pid", type=int, help="with --url: its process, for RSS")
    p.add_argument("--model", help="model for our own server (default: the embedded SmolLM2-135M)")
    p.add_argument("--tiny", action="store_true", help="our own server on a tiny random llama")
    p.add_argument("--serve-args", help=f"`tokenmill serve` flags for our own server (default: '{SERVE_ARGS}', "
                   f"with --tiny '{TINY_SERVE_ARGS}')")
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", action="append", default=[], choices=list(KINDS), metavar="KIND",
                   help=f"leave a kind of request out (repeatable): {', '.join(KINDS)}")
    p.add_argument("--server-log", type=Path, help="keep our own server's log here (default: a temp file)")
    p.add_argument("--faults", default="",
                   help="our own server: inject faults (TOKENMILL_FAULTS, tokenmill/testing/faults.py), e.g. "
                        f"'{DEFAULT_FAULTS}'; 'default' for that. Requests they fail count as 'fault', not lost")
    _servers.add_port_argument(p)  # our own server's
    args = p.parse_args()
    _servers.install(args.port)
    if args.url:
        t = asyncio.run(target_info(args.url.rstrip("/"), args.api_key, args.server_pid))
        sys.exit(asyncio.run(Soak(t, args).run()))
    from server_harness import start_server
    from tiny import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        model = make_tiny_model(Path(tmp) / "model", "llama") if args.tiny else args.model
        default = TINY_SERVE_ARGS if args.tiny else SERVE_ARGS
        key, log = secrets.token_hex(8), args.server_log or Path(tmp) / "server.log"
        if args.faults:
            os.environ["TOKENMILL_FAULTS"] = DEFAULT_FAULTS if args.faults == "default" else args.faults
        server = start_server(model, log, *shlex.split(args.serve_args or default), api_key=key, timeout=300,
                              port=_servers.next_port())
        try:
            print(f"server {server.base_url} pid {server.proc.pid}: {model or 'embedded SmolLM2-135M'} "
                  f"{args.serve_args or default}; {args.concurrency} workers for {args.minutes:g} min; "
                  f"faults: {os.environ.get('TOKENMILL_FAULTS') or 'none'}", flush=True)
            t = asyncio.run(target_info(server.base_url, key, server.proc.pid))
            rc = asyncio.run(Soak(t, args).run())
            raised = Counter(ln for ln in server.log().splitlines() if re.match(r"\w+(Error|Exception): ", ln))
            for line, n in raised.most_common(10):
                print(f"server log: {n} x {line[:200]}")
        finally:
            code = server.stop()
            if code not in (0, -15):
                print(f"server exited with {code}; log tail:\n{server.log()[-3000:]}")
        sys.exit(rc)


if __name__ == "__main__":
    main()
