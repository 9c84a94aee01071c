"""Prefix-aware vs round-robin routing over two real tokenmill replicas, side by side.

Workload: 8 system prompts shared by 64 requests (each with its own short question), sent through
`tokenmill router` with a fixed concurrency. Each replica's KV pool holds only about half of the system
prompts, so round-robin (every replica sees every prefix) keeps evicting them, while prefix-aware routing
gives each prefix a home. Printed: prefix-cache hit rate (from the replicas' /metrics, in tokens) and
client-side TTFT P50 per policy, and prefix-aware / round-robin as ratios. Each run uses fresh system
prompts, so the previous run's cache does not help; rounds alternate the order.

    python benchmarks/routing.py                  # tiny random model (hidden 256, 4 layers), ~1-2 min
    python benchmarks/routing.py --rounds 2
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import _servers  # noqa: E402
from server_harness import LiveServer, start_server  # noqa: E402
from tiny import make_tiny_model  # noqa: E402


def make_requests(seed: int, args) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 300) for _ in range(args.system_tokens)] for _ in range(args.num_prefixes)]
    prompts = [p + [rng.randrange(10, 300) for _ in range(args.question_tokens)]
               for p in prefixes for _ in range(args.num_requests // args.num_prefixes)]
    rng.shuffle(prompts)
    return prompts


async def one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> float:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start = time.perf_counter()
    ttft = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"text"' in line:
                ttft = time.perf_counter() - start
    assert ttft is not None, "no token came back"
    return ttft


async def run_load(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> list[float]:
    sem = asyncio.Semaphore(concurrency)

    async def limited(p: list[int]) -> float:
        async with sem:
            return await one(client, url, p, max_tokens)

    async with httpx.AsyncClient(timeout=300) as client:
        return await asyncio.gather(*(limited(p) for p in prompts))


def start_router(backends: list[str], policy: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = _servers.next_port()
    cmd = [sys.executable, "-m", "tokenmill", "router", "--policy", policy, "--port", str(port),
           "--uvicorn-log-level", "warning"]
    for b in backends:
        cmd += ["--backend", b]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"router did not start:\n{log.read_text()}")


def cache_counters(servers: list[LiveServer]) -> tuple[float, float]:
    hits = queries = 0.0
    for s in servers:
        m = s.metrics()
        hits += m["tokenmill:prefix_cache_hits_total"]
        queries += m["tokenmill:prefix_cache_queries_total"]
    return hits, queries


def run_policy(policy: str, servers: list[LiveServer], seed: int, args, logdir: Path) -> dict:
    proc, url = start_router([s.base_url for s in servers], policy, logdir / f"router-{policy}-{seed}.log")
    try:
        time.sleep(0.3)  # a first kv_events poll
        h0, q0 = cache_counters(servers)
        start = time.perf_counter()
        ttfts = asyncio.run(run_load(url, make_requests(seed, args), args.concurrency, args.max_tokens))
        wall = time.perf_counter() - start
        h1, q1 = cache_counters(servers)
    finally:
        proc.terminate()
        proc.wait(10)
    return {"hit_rate": (h1 - h0) / max(q1 - q0, 1), "ttft_p50": statistics.median(ttfts), "wall": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--question-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--kv-cache", default="10M", help="KV pool per replica (default: about half of the 8 prefixes).")
    p.add_argument("--rounds", type=int, default=1)
    _servers.add_port_argument(p)
    args = p.parse_args()
    _servers.install(args.port)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = make_tiny_model(tmp / "model", "llama", hidden_size=256, intermediate_size=512,
                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=2048)
        flags = ("--kv-cache-memory-bytes", args.kv_cache, "--max-num-seqs", "4", "--block-size", "16",
                 "--max-model-len", "1024")
        with ThreadPoolExecutor(2) as pool:
            ports = [_servers.next_port() for _ in range(2)]
            servers = list(pool.map(lambda i: start_server(model, tmp / f"replica{i}.log", *flags, port=ports[i]),
                                    range(2)))
        try:
            results: dict[str, list[dict]] = {"round-robin": [], "prefix-aware": []}
            for r in range(args.rounds):
                order = ["round-robin", "prefix-aware"] if r % 2 == 0 else ["prefix-aware", "round-robin"]
                for i, policy in enumerate(order):
                    res = run_policy(policy, servers, seed=100 * r + i, args=args, logdir=tmp)
                    results[policy].append(res)
                    print(f"round {r} {policy:>12}: hit rate {res['hit_rate']:.1%}, TTFT P50 "
                          f"{res['ttft_p50'] * 1e3:.1f} ms, wall {res['wall']:.2f} s", flush=True)
        finally:
            for s in servers:
                s.stop()

    def med(policy: str, key: str) -> float:
        return statistics.median(x[key] for x in results[policy])

    rr_hit, pa_hit = med("round-robin", "hit_rate"), med("prefix-aware", "hit_rate")
    print(f"\n{args.num_prefixes} system prompts x {args.num_requests} requests ({args.system_tokens}+"
          f"{args.question_tokens} tokens), 2 replicas, concurrency {args.concurrency}")
    print(f"prefix-cache hit rate: prefix-aware {pa_hit:.1%} vs round-robin {rr_hit:.1%} "
          f"(x{pa_hit / max(rr_hit, 1e-9):.2f})")
    print(f"TTFT P50: prefix-aware / round-robin = {med('prefix-aware', 'ttft_p50') / med('round-robin', 'ttft_p50'):.2f}")
    print(f"wall: prefix-aware / round-robin = {med('prefix-aware', 'wall') / med('round-robin', 'wall'):.2f}")


if __name__ == "__main__":
    main()
