"""Serving-shaped load in process: the engine's `step()` with C requests kept in flight (a new one added as
each finishes), as `vllm bench serve --max-concurrency C` drives a server, without HTTP or a client
competing for the cores. For profiling a step mix (`--profile`: torch.profiler's top ops) and for A/B of
an environment switch in fresh processes, alternating (`--ab TOKENMILL_ONEDNN_PACK`: runs with the variable
0 and 1 in turn and prints the ratio).

    python benchmarks/concurrency.py --dtype bfloat16 --threads 1 --concurrency 16 --requests 32
    python benchmarks/concurrency.py --dtype bfloat16 --threads 1 --ab TOKENMILL_FUSED_OPS --rounds 2
    python benchmarks/concurrency.py --dtype float32 --profile

The model is the embedded SmolLM2-135M GGUF converted once into a float32 Hugging Face folder (under --work;
the same folder benchmarks/peers.py gives vLLM), random prompt ids, greedy, EOS ignored."""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time


def run(args) -> dict:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from peers import hf_folder

    from tokenmill import LLM, SamplingParams
    from tokenmill.model.default import default_model_path

    torch.set_num_threads(args.threads)
    folder = hf_folder(default_model_path(), args.work)
    llm = LLM(folder, dtype=args.dtype, max_model_len=args.input_len + args.output_len + 16,
              enable_prefix_caching=False)
    engine = llm.engine
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.input_len)] for _ in range(args.requests)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    ids = iter(range(10**9))

    def drive(n: int, prof=None) -> tuple[float, int]:
        queue = list(range(n))
        inflight = tokens = steps = 0
        t = time.perf_counter()
        while queue and inflight < args.concurrency:
            engine.add_request(f"r{next(ids)}", None, sp, prompt_token_ids=prompts[queue.pop(0)])
            inflight += 1
        while inflight:
            for out in engine.step():
                if out.finished:
                    inflight -= 1
                    tokens += len(out.outputs[0].token_ids)
                    if queue:
                        engine.add_request(f"r{next(ids)}", None, sp, prompt_token_ids=prompts[queue.pop(0)])
                        inflight += 1
            steps += 1
            if prof is not None:
                prof.step()
        return tokens / (time.perf_counter() - t), steps

    drive(min(args.concurrency, args.requests))  # warm-up
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as p:
            tok_s, steps = drive(args.requests, p)
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    else:
        tok_s, steps = drive(args.requests)
    llm.close()
    return {"tok_s": tok_s, "steps": steps, "load": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--work", default=os.path.join(os.path.expanduser("~"), ".cache", "tokenmill-peers"))
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--ab", default=None, help="environment variable to set to 0 and 1 in alternating runs")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one run, result as JSON
    args = ap.parse_args()
    if args.json or (args.ab is None):
        r = run(args)
        if args.json:
            print("CONCURRENCY_RESULT", json.dumps(r))
        else:
            print(f"{args.dtype}, {args.threads} thread(s), concurrency {args.concurrency}, {args.requests} requests "
                  f"of {args.input_len} in / {args.output_len} out: {r['tok_s']:.1f} out tok/s, {r['steps']} steps "
                  f"[load {r['load']:.2f}]")
        return
    argv = [a for a in sys.argv[1:]]
    best = {"0": 0.0, "1": 0.0}
    for i in range(args.rounds):
        for v in ("0", "1"):
            env = dict(os.environ, **{args.ab: v}, OMP_NUM_THREADS=str(args.threads))
            out = subprocess.run([sys.executable, __file__, *argv, "--json"], env=env, capture_output=True,
                                 text=True, timeout=3600)
            if out.returncode != 0:
                raise RuntimeError(out.stderr[-3000:])
            line = next(ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("CONCURRENCY_RESULT "))
            r = json.loads(line.split(" ", 1)[1])
            best[v] = max(best[v], r["tok_s"])
            print(f"round {i + 1}: {args.ab}={v}: {r['tok_s']:.1f} out tok/s [load {r['load']:.2f}]", flush=True)
    print(f"best of {args.rounds}: {args.ab}=1 / {args.ab}=0 = {best['1'] / best['0']:.2f}x "
          f"({best['1']:.1f} against {best['0']:.1f} out tok/s)")


if __name__ == "__main__":
    main()
