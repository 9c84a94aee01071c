"""`tokenmill bench throughput` and `tokenmill bench latency`: in-process, no server.

Both end with the engine's "where the time went" report (tokenmill.diagnostics): the time split
per step phase, achieved FLOP/s and bandwidth against this machine's measured peaks, attention's time
per step, its share of the forward pass and its achieved K/V read bandwidth against the calibrated
one, and whether the run was compute-, bandwidth- or overhead-bound. --output-json records the same
under "diagnostics" ("attention" for the attention figures).
"""
from __future__ import annotations

import json
import statistics
import time
from typing import Callable


def _random_prompts(vocab: int, n: int, input_len: int, range_ratio: float, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    lo = max(1, int(input_len * (1 - range_ratio)))
    hi = max(lo, int(input_len * (1 + range_ratio)))
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    # Skip the lowest ids, where tokenizers keep their special tokens.
    return [torch.randint(min(100, vocab - 1), vocab, (k,), generator=g).tolist() for k in lens]


def run_throughput(args, engine_kwargs: Callable) -> int:
    from tokenmill import LLM, SamplingParams
    from tokenmill.diagnostics import engine_diagnostics, format_report

    llm = LLM(**engine_kwargs(args))
    e = llm.engine
    prompts = _random_prompts(e.vocab_size, args.num_prompts, args.input_len, args.range_ratio, args.seed)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    e.stats.history.clear()
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=not args.quiet)
    dt = time.perf_counter() - t
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    diag = engine_diagnostics(e)
    result = {
        "num_prompts": len(prompts), "elapsed_s": dt, "requests_per_s": len(prompts) / dt,
        "input_tokens": n_in, "output_tokens": n_out, "output_tokens_per_s": n_out / dt,
        "total_tokens_per_s": (n_in + n_out) / dt, "diagnostics": diag,
    }
    print(f"throughput: {len(prompts) / dt:.2f} requests/s, {n_out / dt:.1f} output tokens/s, "
          f"{(n_in + n_out) / dt:.1f} total tokens/s ({len(prompts)} requests, {dt:.1f} s)")
    print(format_report(diag))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def run_latency(args, engine_kwargs: Callable) -> int:
    from tokenmill import SamplingParams
    from tokenmill.diagnostics import engine_diagnostics, format_report
    from tokenmill.llm import LLM

    llm = LLM(**engine_kwargs(args))
    e = llm.engine
    prompt = _random_prompts(e.vocab_size, 1, args.input_len, 0.0, args.seed)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompt[:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    e.stats.history.clear()
    ttfts, tpots, e2es = [], [], []
    for i in range(args.num_iters):
        # A fresh prefix each time: measure prefill, not the prefix cache.
        ids = [prompt[0] + i % 7 + 1] + prompt[1:]
        t0 = time.perf_counter()
        e.add_request(f"lat-{i}", ids, sp)
        first = None
        while e.has_unfinished_requests():
            for out in e.step():
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter()
        end = time.perf_counter()
        ttfts.append(first - t0)
        e2es.append(end - t0)
        if args.output_len > 1:
            tpots.append((end - first) / (args.output_len - 1))
    diag = engine_diagnostics(e)
    med = statistics.median
    print(f"latency (batch 1, {args.input_len} prompt tokens, {args.output_len} output tokens, {args.num_iters} runs):")
    print(f"  TTFT median {1e3 * med(ttfts):.1f} ms, TPOT median {1e3 * med(tpots) if tpots else 0:.1f} ms, "
          f"E2E median {1e3 * med(e2es):.1f} ms, decode {1 / med(tpots) if tpots else 0:.1f} tokens/s")
    print(format_report(diag))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"ttft_s": ttfts, "tpot_s": tpots, "e2e_s": e2es, "diagnostics": diag}, f, indent=1)
    return 0


def add_offline_parsers(bench_sub, add_engine_args: Callable, engine_kwargs: Callable) -> None:
    p = bench_sub.add_parser("throughput", help="Offline throughput of the engine on random prompts.",
                             description="Run N random prompts through the engine in-process; report tokens/s "
                                         "and where the time went.")
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=64, help="Requests (default: %(default)s).")
    p.add_argument("--input-len", type=int, default=128, help="Mean prompt tokens (default: %(default)s).")
    p.add_argument("--output-len", type=int, default=64, help="Output tokens per request (default: %(default)s).")
    p.add_argument("--range-ratio", type=float, default=0.5,
                   help="Prompt lengths uniform in [len*(1-r), len*(1+r)] (default: %(default)s).")
    p.add_argument("--output-json", help="Write the results and diagnostics as JSON.")
    p.add_argument("-q", "--quiet", action="store_true", help="No progress bar.")
    p.set_defaults(func=lambda a: run_throughput(a, engine_kwargs))

    p = bench_sub.add_parser("latency", help="Batch-1 TTFT and TPOT of the engine.",
                             description="Time one request at a time: TTFT, TPOT, E2E; report where the time went.")
    add_engine_args(p)
    p.add_argument("--input-len", type=int, default=128, help="Prompt tokens (default: %(default)s).")
    p.add_argument("--output-len", type=int, default=32, help="Output tokens (default: %(default)s).")
    p.add_argument("--num-iters", type=int, default=5, help="Timed runs (default: %(default)s).")
    p.add_argument("--output-json", help="Write the timings and diagnostics as JSON.")
    p.set_defaults(func=lambda a: run_latency(a, engine_kwargs))
