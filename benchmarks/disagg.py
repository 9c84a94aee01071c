"""Disaggregated prefill/decode vs one aggregated engine on the same cores, side by side in one run.

Workload: short chats decoding (streamed) while long prompts arrive. Aggregated: one `tokenmill serve` with
all the threads; its long prefills run in the same steps as the chats' decodes (chunked), so the chats'
inter-token latency jumps while a long prompt is computed. PD: a prefill instance and a decode instance with
half the threads each behind `tokenmill router --pd`; the decode instance only loads the long prompts' KV.
Printed: chat ITL P50/P99 in each setup and their ratio, long-prompt TTFT, and the KV transfer's share of it.

    python benchmarks/disagg.py                   # random 4-layer model, 4k-token prompts, 8 chats
    python benchmarks/disagg.py --long-tokens 2048 --chats 4
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import _servers  # noqa: E402
from measure import env_str  # noqa: E402


def launch(args: list[str], threads: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = _servers.next_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(HERE.parent))
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill", *args, "--port", str(port)], env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{args[0]} exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{args[0]} did not start")


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


async def chat(client: httpx.AsyncClient, url: str, ids: list[int], max_tokens: int, gaps: list[float]) -> None:
    body = {"model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    last = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now


async def long_prompt(client: httpx.AsyncClient, url: str, ids: list[int], ttfts: list[float]) -> None:
    body = {"model": "m", "prompt": ids, "max_tokens": 4, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        first = True
        async for line in r.aiter_lines():
            if first and line.startswith("data: "):
                ttfts.append(time.perf_counter() - t0)
                first = False


async def workload(url: str, args, rng: random.Random) -> tuple[list[float], list[float]]:
    gaps: list[float] = []
    ttfts: list[float] = []
    async with httpx.AsyncClient(timeout=600) as client:
        chats = [chat(client, url, [rng.randrange(100, 300) for _ in range(32)], args.chat_tokens, gaps)
                 for _ in range(args.chats)]

        async def longs():
            await asyncio.sleep(args.first_long_s)
            for i in range(args.longs):
                ids = [rng.randrange(100, 300) for _ in range(args.long_tokens)]
                await long_prompt(client, url, ids, ttfts)
                await asyncio.sleep(args.long_gap_s)

        await asyncio.gather(*chats, longs())
    return gaps, ttfts


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--chat-tokens", type=int, default=160)
    ap.add_argument("--longs", type=int, default=3)
    ap.add_argument("--long-tokens", type=int, default=4096)
    ap.add_argument("--first-long-s", type=float, default=1.0)
    ap.add_argument("--long-gap-s", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=2, help="cores in all (aggregated: all; PD: half each)")
    _servers.add_port_argument(ap)
    args = ap.parse_args()
    _servers.install(args.port)
    from tiny import make_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="disagg-"))
    model = make_tiny_model(tmp / "model", "llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
    common = ["serve", str(model), "--served-model-name", "m", "--max-model-len", "8192", "--kv-cache-memory-bytes",
              "256M", "--block-size", "16", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    print(f"{args.chats} chats x {args.chat_tokens} tokens while {args.longs} prompts of {args.long_tokens} tokens "
          f"arrive; {args.threads} threads in all {env_str()}")
    results = {}
    procs = []
    try:
        proc, url = launch(common, args.threads, tmp / "agg.log")
        procs.append(proc)
        results["aggregated"] = asyncio.run(workload(url, args, random.Random(0)))
        proc.terminate()
        proc.wait(30)

        def role(r: str) -> list[str]:
            return ["--kv-transfer-config", json.dumps({"kv_role": r, "kv_connector_extra_config":
                                                       {"shared_storage_path": str(tmp / "kv")}})]

        half = max(1, args.threads // 2)
        pre, pre_url = launch(common + role("kv_producer"), half, tmp / "prefill.log")
        dec, dec_url = launch(common + role("kv_consumer"), half, tmp / "decode.log")
        rt, rt_url = launch(["router", "--pd", "--prefill", pre_url, "--backend", dec_url, "--policy",
                             "least-load", "--uvicorn-log-level", "warning"], 1, tmp / "router.log")
        procs += [pre, dec, rt]
        moved0 = metric(dec_url, "tokenmill:kv_transfer_seconds_total") + \
            metric(pre_url, "tokenmill:kv_transfer_seconds_total")
        results["PD"] = asyncio.run(workload(rt_url, args, random.Random(0)))
        moved = metric(dec_url, "tokenmill:kv_transfer_seconds_total") + \
            metric(pre_url, "tokenmill:kv_transfer_seconds_total") - moved0
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    for name, (gaps, ttfts) in results.items():
        print(f"{name:>10}: chat ITL P50 {1e3 * pct(gaps, 0.5):7.1f} ms  P99 {1e3 * pct(gaps, 0.99):7.1f} ms  "
              f"max {1e3 * max(gaps):7.1f} ms; long-prompt TTFT mean {statistics.mean(ttfts):.2f} s")
    agg, pd = results["aggregated"], results["PD"]
    print(f"chat ITL P99: PD / aggregated = {pct(pd[0], 0.99) / pct(agg[0], 0.99):.2f}; "
          f"P50 {pct(pd[0], 0.5) / pct(agg[0], 0.5):.2f}")
    print(f"KV transfer (producer writes + consumer loads) = {100 * moved / sum(pd[1]):.1f}% of the long prompts' "
          f"TTFT under PD ({moved:.3f} s of {sum(pd[1]):.2f} s)")
    print("load average after:", open("/proc/loadavg").read().split()[:3])


if __name__ == "__main__":
    main()
