"""Prefix caching on vs off, side by side in one process, on the embedded SmolLM2 (or --model).

Shared-prefix workload (the issue's shape): 4 system prompts of 1,024 tokens shared by 64 requests,
each with its own 64-token question, 16 output tokens, greedy, all submitted at once. Printed: TTFT
P50 (RequestOutput.metrics: first_token_time - arrival_time) and throughput, on vs off, as ratios,
and the prefix-cache hit rate in tokens. Then the overhead at 0% hit rate: all prompts distinct,
on and off interleaved in rounds so machine noise hits both alike; besides the throughput ratio (at
the mercy of whatever else runs on the machine) it prints the engine's own scheduling time on vs
off, where caching's work (hashing, lookups) happens, as a share of the wall time.

    python benchmarks/prefix_cache.py                       # the issue's shape (a few minutes on 2 cores)
    python benchmarks/prefix_cache.py --num-requests 16 --distinct-requests 4 --rounds 2   # quick look
    python benchmarks/prefix_cache.py --offload             # also: KV offloading to host and disk
    python benchmarks/prefix_cache.py --offload-only        # only that
    python benchmarks/prefix_cache.py --salted              # also: the cost of per-tenant salts (docs/tenants.md)

--offload: a device pool too small for the 4 system prompts, requests one at a time cycling through
them (so an LRU pool always misses); TTFT with recompute vs the host tier vs the disk tier.
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import tempfile
import time

WORDS = ("the model serves many users at once with paged attention and continuous batching of requests "
         "while the scheduler keeps a token budget for every step of the engine loop and a cache of "
         "blocks keyed by the hash of their prefix so that system prompts tool definitions and history "
         "are computed once").split()


def text_tokens(tokenizer, n: int, rng: random.Random) -> list[int]:
    """Exactly n token ids of English-looking text."""
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer(" ".join(rng.choice(WORDS) for _ in range(n)), add_special_tokens=False).input_ids
    return ids[:n]


def shared_prefix_prompts(tokenizer, args, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [text_tokens(tokenizer, args.system_len, rng) for _ in range(args.num_systems)]
    return [systems[i % args.num_systems] + text_tokens(tokenizer, args.question_len, rng)
            for i in range(args.num_requests)]


def distinct_prompts(tokenizer, args, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [text_tokens(tokenizer, args.system_len + args.question_len, rng) for _ in range(n)]


def measure(llm, prompts, params, cache_salt: str | None = None) -> dict:
    """Run all prompts at once; throughput counts prompt and output tokens over the wall time."""
    kv, stats = llm.engine.kv, llm.engine.stats
    q0, h0, s0 = kv.stats.queries, kv.stats.hits, stats.schedule_s
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, cache_salt=cache_salt)
    wall = time.perf_counter() - t
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    tokens = sum(len(p) for p in prompts) + out_tokens
    queries, hits = kv.stats.queries - q0, kv.stats.hits - h0
    return dict(wall=wall, ttft_p50=statistics.median(ttft), tok_s=tokens / wall, req_s=len(prompts) / wall,
                schedule_s=stats.schedule_s - s0,
                hit_rate=hits / queries if queries else 0.0, outputs=[o.outputs[0].token_ids for o in outs])


def spread(xs: list[float]) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{statistics.median(xs):.3f} (min {min(xs):.3f}, max {max(xs):.3f}, n={len(xs)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path or GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--num-systems", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--distinct-requests", type=int, default=4, help="requests per round at 0%% hit rate")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved on/off rounds at 0%% hit rate")
    ap.add_argument("--repeats", type=int, default=1, help="shared-prefix runs per setting (fresh prompts)")
    ap.add_argument("--offload", action="store_true", help="also measure KV offloading (host and disk tiers)")
    ap.add_argument("--offload-only", action="store_true", help="only the offloading measurement")
    ap.add_argument("--salted", action="store_true", help="also: the shared-prefix workload salted as one tenant")
    ap.add_argument("--offload-requests", type=int, default=12, help="sequential requests in the offload test")
    args = ap.parse_args()

    from tokenmill import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, min_tokens=args.output_len, ignore_eos=True)
    if args.offload_only:
        offload_section(args, params)
        return
    llms = {}
    for name, caching in (("on", True), ("off", False)):
        t = time.perf_counter()
        llms[name] = LLM(args.model, max_model_len=args.max_model_len, enable_prefix_caching=caching)
        tok = llms[name].get_tokenizer()
        # Warm-up on unrelated text: first-use costs (allocations, kernels) land outside the timings.
        llms[name].generate(distinct_prompts(tok, args, 2, seed=999), params, use_tqdm=False)
        print(f"caching {name}: ready in {time.perf_counter() - t:.1f} s, {llms[name].engine.kv.num_blocks} KV blocks")
    tok = llms["on"].get_tokenizer()

    print(f"\nshared prefix: {args.num_systems} system prompts x {args.system_len} tokens, {args.num_requests} requests "
          f"with {args.question_len}-token questions, {args.output_len} output tokens")
    res: dict[str, list[dict]] = {"on": [], "off": []}
    for r in range(args.repeats):
        prompts = shared_prefix_prompts(tok, args, seed=r)
        order = ("on", "off") if r % 2 == 0 else ("off", "on")
        for name in order:
            res[name].append(measure(llms[name], prompts, params))
            m = res[name][-1]
            print(f"  caching {name:>3}: wall {m['wall']:6.1f} s  TTFT P50 {m['ttft_p50']:6.2f} s  "
                  f"{m['tok_s']:7.1f} tok/s  {m['req_s']:5.2f} req/s  hit rate {100 * m['hit_rate']:5.1f}%")
        same = res["on"][-1]["outputs"] == res["off"][-1]["outputs"]
        print(f"  greedy outputs identical on vs off: {same}")
    ttft_ratio = [off["ttft_p50"] / on["ttft_p50"] for on, off in zip(res["on"], res["off"])]
    tput_ratio = [on["tok_s"] / off["tok_s"] for on, off in zip(res["on"], res["off"])]
    bound = (args.num_requests - args.num_systems) * args.system_len / (args.num_requests * (args.system_len + args.question_len))
    print(f"  TTFT P50 off/on:      {spread(ttft_ratio)}x")
    print(f"  throughput on/off:    {spread(tput_ratio)}x")
    print(f"  hit rate (tokens):    {spread([100 * m['hit_rate'] for m in res['on']])}%  "
          f"(this shape's ceiling: {100 * bound:.1f}%; the first request of each system prompt computes it)")

    if args.salted:
        salt_section(llms["on"], tok, args, params)

    print(f"\n0% hit rate: {args.rounds} rounds of {args.distinct_requests} distinct prompts of "
          f"{args.system_len + args.question_len} tokens, on and off interleaved")
    walls: dict[str, list[float]] = {"on": [], "off": []}
    sched: dict[str, float] = {"on": 0.0, "off": 0.0}
    tokens = {"on": 0, "off": 0}
    for r in range(args.rounds):
        prompts = distinct_prompts(tok, args, args.distinct_requests, seed=1000 + r)
        for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
            m = measure(llms[name], prompts, params)
            assert m["hit_rate"] == 0.0 or name == "off"
            walls[name].append(m["wall"])
            sched[name] += m["schedule_s"]
            tokens[name] += sum(len(p) for p in prompts) + args.output_len * len(prompts)
            print(f"  round {r} caching {name:>3}: {m['tok_s']:7.1f} tok/s  hit rate {100 * m['hit_rate']:.1f}%")
    per_round = [w_off / w_on for w_on, w_off in zip(walls["on"], walls["off"])]
    overall = (tokens["on"] / sum(walls["on"])) / (tokens["off"] / sum(walls["off"]))
    print(f"  throughput on/off:    {overall:.3f}x overall; per round {spread(per_round)}x  "
          f"(overhead {100 * (1 - overall):+.1f}%)")
    extra = (sched["on"] - sched["off"]) / sum(walls["on"])
    print(f"  scheduling time:      on {sched['on']:.3f} s, off {sched['off']:.3f} s of {sum(walls['on']):.1f} s wall: "
          f"caching's own work is {100 * extra:+.2f}% of the wall time")
    del llms
    gc.collect()
    if args.offload:
        offload_section(args, params)


def salt_section(llm, tok, args, params) -> None:
    """The cost of per-tenant salts (serve/tenants/isolation.py): the shared-prefix workload as one tenant sends it
    (every request with that tenant's salt) against unsalted, fresh prompts each run, interleaved. Within one
    tenant the hit rate must not change; a second tenant's identical prompts must hit nothing."""
    import json

    salt_a, salt_b = json.dumps(["team-a", None]), json.dumps(["team-b", None])
    print(f"\nsalting: the shared-prefix workload unsalted vs as one tenant (salted), {args.repeats} run(s) each")
    rows: dict[str, list[dict]] = {"unsalted": [], "salted": []}
    for r in range(max(args.repeats, 1)):
        for name in (("unsalted", "salted") if r % 2 == 0 else ("salted", "unsalted")):
            prompts = shared_prefix_prompts(tok, args, seed=200 + 2 * r + (name == "salted"))
            rows[name].append(measure(llm, prompts, params, salt_a if name == "salted" else None))
            m = rows[name][-1]
            print(f"  {name:>8}: wall {m['wall']:6.1f} s  TTFT P50 {m['ttft_p50']:6.2f} s  {m['tok_s']:7.1f} tok/s  "
                  f"hit rate {100 * m['hit_rate']:5.1f}%")
        if r == 0:  # the same prompts again under another tenant's salt: nothing to hit
            other = measure(llm, shared_prefix_prompts(tok, args, seed=201), params, salt_b)
            print(f"  another tenant, the same prompts: hit rate {100 * other['hit_rate']:5.1f}% "
                  f"(the ceiling again: its own system prompts, none of team-a's blocks)")
    hit = {k: statistics.mean(m["hit_rate"] for m in v) for k, v in rows.items()}
    tput = statistics.mean(m["tok_s"] for m in rows["salted"]) / statistics.mean(m["tok_s"] for m in rows["unsalted"])
    print(f"  hit rate salted {100 * hit['salted']:.1f}% vs unsalted {100 * hit['unsalted']:.1f}%; "
          f"throughput salted/unsalted {tput:.3f}x")


def offload_section(args, params) -> None:
    from tokenmill import LLM

    bs = 16
    # One max-length request must fit; beyond that, room for about half the system prompts.
    per_system = -(-(args.system_len + args.question_len + args.output_len) // bs)
    pool = max(-(-args.max_model_len // bs), per_system * max(args.num_systems // 2, 1) + per_system // 2)
    print(f"\noffload: a pool of {pool} blocks, {args.offload_requests} requests one at a time cycling through "
          f"{args.num_systems} system prompts of {args.system_len} tokens")
    tmp = tempfile.mkdtemp(prefix="tokenmill-bench-")
    setups = {
        "recompute": {},
        "host tier": dict(kv_offload_bytes=1 << 30),
        "disk tier": dict(kv_offload_bytes=1, kv_offload_dir=tmp),  # host holds one staging group only
    }
    base = None
    for name, kw in setups.items():
        llm = LLM(args.model, max_model_len=args.max_model_len, num_gpu_blocks_override=pool, **kw)
        tok = llm.get_tokenizer()
        a = argparse.Namespace(**{**vars(args), "num_requests": args.offload_requests})
        prompts = shared_prefix_prompts(tok, a, seed=7)
        llm.generate(prompts[: args.num_systems], params, use_tqdm=False)  # every system prompt seen once
        ttft = []
        for p in prompts:
            ttft.append(measure(llm, [p], params)["ttft_p50"])
        mean = statistics.mean(ttft)
        base = base or mean
        off = llm.engine.kv.offload
        extra = ""
        if off is not None:
            st = off.stats
            extra = (f"  loads host {st.host_loads} disk {st.disk_loads}, saves {st.saves}, spills {st.spills}, "
                     f"break-even {off.break_even_blocks}")
        print(f"  {name:<10} TTFT mean {mean:6.3f} s ({base / mean:5.1f}x)  cached tokens/request "
              f"{llm.engine.kv.stats.hits / max(llm.engine.kv.stats.queries, 1) * 100:5.1f}%{extra}")
        del llm
        gc.collect()


if __name__ == "__main__":
    main()
