"""Structured output (llguidance) cost on the embedded SmolLM2-135M-Instruct (or --model), in one process:

(a) decode step time of N concurrent json_schema requests vs the same N requests unconstrained: same chat
    prompts, temperature 1 with per-request seeds, EOS ignored and a schema whose shortest valid output is far
    longer than --output-len, so every request in both runs decodes exactly --output-len tokens. Compared:
    the mean busy time (StepStats.busy_s: schedule + grammar + prepare + forward + sample + detokenize) of the
    decode-only steps in which all N requests decode, from the engine's step history; the two runs alternate
    for --rounds rounds and each side's figure is the median over rounds. Printed: the ratio (target <= 1.10x)
    and the bitmask fill time per step (StepStats.grammar_s).
(b) grammar compile time (text -> llguidance grammar -> LLMatcher against the model's tokenizer), P50/P99 over
    the 200 schemas of tests/structured_cases.json_schemas(200), each compiled once (nothing cached), and the
    one-off build of llguidance's tokenizer view.
(c) time to first token of one constrained request whose schema was never seen (the request waits in the
    queue for its compile) vs the same schema again (a compiled-grammar cache hit) vs no constraint.

    python benchmarks/structured.py            # 32 requests x 128 tokens, 3 rounds (about 4 minutes on 2 cores)
    python benchmarks/structured.py --quick    # 32 requests x 32 tokens, 1 round

Every figure line carries the load average and torch's thread count; every timed run says how many cores
other processes used meanwhile (the machine may be shared).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

from measure import OtherLoad, env_str, warn_if_busy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

TOPICS = ["employees of a bakery", "members of a chess club", "students in a physics class", "guests at a wedding",
          "players of a football team", "authors at a book fair", "customers of a bike shop", "hikers on a trail"]

# An array of at least 50 records: every request is still inside it after --output-len tokens, whatever it
# samples. Strings, an enum, bounded integers and a pattern: the usual mix of lexer states.
RECORDS_SCHEMA = {
    "type": "array",
    "minItems": 50,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "enum": ["Paris", "London", "Berlin", "Madrid", "Rome", "Vienna"]},
            "email": {"type": "string", "pattern": "^[a-z]{2,12}@[a-z]{3,10}\\.(com|org|net)$"},
            "active": {"type": "boolean"},
        },
        "required": ["name", "age", "city", "email", "active"],
        "additionalProperties": False,
    },
}


def cpu_line() -> str:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return (f"cpu: {model}, {os.cpu_count()} cores; torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")


def chat_prompts(tok, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        msg = (f"List {50 + i} {TOPICS[i % len(TOPICS)]} as a JSON array of objects with the fields name, age, "
               "city, email and active.")
        text = tok.apply_chat_template([{"role": "user", "content": msg}], tokenize=False, add_generation_prompt=True)
        prompts.append(tok(text, add_special_tokens=False).input_ids)
    return prompts


def decode_run(llm, prompts, output_len: int, constrained: bool) -> dict:
    from tokenmill import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json=RECORDS_SCHEMA) if constrained else None
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=output_len, ignore_eos=True, structured_outputs=so)
              for i in range(len(prompts))]
    engine = llm.engine
    engine.core.reset_prefix_cache()
    history = engine.stats.history
    history.clear()
    watch = OtherLoad()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    others = watch.cores()
    n = len(prompts)
    lens = [len(c.token_ids) for o in outs for c in o.outputs]
    if constrained:
        import json

        for o in outs:  # an unfinished array: its text is a prefix of valid JSON
            text = o.outputs[0].text
            assert text.lstrip().startswith("[") and o.outputs[0].finish_reason == "length", text[:80]
            try:
                json.loads(text)
                raise AssertionError("a complete JSON text after --output-len tokens: the schema is too short")
            except json.JSONDecodeError:
                pass
    full = [s for s in history if s.num_requests == n and s.num_tokens == n]  # all N decode one token each
    return {
        "steps": full,
        "busy": statistics.fmean(s.busy_s for s in full) if full else float("nan"),
        "grammar": statistics.fmean(s.grammar_s for s in full) if full else float("nan"),
        "forward": statistics.fmean(s.forward_s for s in full) if full else float("nan"),
        "sample": statistics.fmean(s.sample_s for s in full) if full else float("nan"),
        "lens": lens,
        "wall": wall,
        "others": warn_if_busy(others, "during this run"),
        "env": env_str(),
    }


def part_a(llm, args) -> dict:
    tok = llm.get_tokenizer()
    prompts = chat_prompts(tok, args.num_requests)
    lens = [len(p) for p in prompts]
    print(f"\n(a) decode steps: {args.num_requests} concurrent requests, chat prompts of {min(lens)}-{max(lens)} tokens, "
          f"{args.output_len} output tokens each (EOS ignored), temperature 1 seeded; json_schema: an array of >= 50 "
          "records (strings, enum, integers, pattern, boolean) vs unconstrained")
    # Warm-up: llguidance's tokenizer view and this schema's compile, and torch's first calls.
    decode_run(llm, prompts[:4], 4, True)
    decode_run(llm, prompts[:4], 4, False)
    runs = {False: [], True: []}
    for r in range(args.rounds):
        for constrained in (False, True):
            run = decode_run(llm, prompts, args.output_len, constrained)
            runs[constrained].append(run)
            name = "json_schema  " if constrained else "unconstrained"
            assert all(n == args.output_len for n in run["lens"]), run["lens"]
            print(f"  round {r + 1} {name}: {1e3 * run['busy']:.2f} ms/step over {len(run['steps'])} decode steps "
                  f"with all {args.num_requests} (forward {1e3 * run['forward']:.2f}, sample {1e3 * run['sample']:.2f}, "
                  f"grammar {1e3 * run['grammar']:.3f}); wall {run['wall']:.2f} s  {run['env']}")
            if run["others"]:
                print("    " + run["others"])
    med = {k: statistics.median(r["busy"] for r in v) for k, v in runs.items()}
    grammar = statistics.median(r["grammar"] for r in runs[True])
    ratio = med[True] / med[False]
    verdict = "met" if ratio <= 1.10 else "MISSED"
    print(f"  decode step, median over {args.rounds} round(s): json_schema {1e3 * med[True]:.2f} ms vs unconstrained "
          f"{1e3 * med[False]:.2f} ms: ratio {ratio:.3f}x (target <= 1.10x: {verdict})  {env_str()}")
    print(f"  grammar_s (bitmask fill for {args.num_requests} rows) per decode step: {1e3 * grammar:.3f} ms = "
          f"{100 * grammar / med[True]:.1f}% of the constrained step")
    # The forward pass is the same work in both runs, and on a shared machine its time is most of the noise:
    # the constraint's own cost is the rest of the step (grammar fill, masking in the sampler, bookkeeping).
    rest = {k: statistics.median(r["busy"] - r["forward"] for r in v) for k, v in runs.items()}
    fwd = statistics.median(r["forward"] for r in runs[False])
    added = rest[True] - rest[False]
    print(f"  step minus forward: json_schema {1e3 * rest[True]:.2f} ms vs unconstrained {1e3 * rest[False]:.2f} ms "
          f"(+{1e3 * added:.2f} ms); with the unconstrained forward time in both: ratio "
          f"{(fwd + rest[True]) / (fwd + rest[False]):.3f}x")
    return {"ratio": ratio, "grammar_ms": 1e3 * grammar, "step_ms": {k: 1e3 * v for k, v in med.items()},
            "added_ms": 1e3 * added, "ratio_same_forward": (fwd + rest[True]) / (fwd + rest[False])}


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def part_b(llm, args) -> dict:
    import structured_cases as sc

    from tokenmill import StructuredOutputsParams
    from tokenmill.structured_output.grammar import to_grammar

    mgr = llm.engine.core.structured
    had = mgr._lltok is not None
    t0 = time.perf_counter()
    mgr.tokenizer()
    tok_s = time.perf_counter() - t0
    schemas = sc.json_schemas(200)
    # Warm-up: llguidance's first compile pays for its own lazy set-up; use a schema outside the 200.
    mgr._compile(to_grammar(StructuredOutputsParams(json={"type": "object", "properties": {"warm": {"type": "integer"}}})))
    times, texts = [], []
    watch = OtherLoad()
    for s in schemas:
        t = time.perf_counter()
        grammar = to_grammar(StructuredOutputsParams(json=s))
        mgr._compile(grammar)
        times.append(time.perf_counter() - t)
        texts.append(len(grammar))
    others = warn_if_busy(watch.cores(), "during the compiles")
    print(f"\n(b) grammar compile (to_grammar + LLMatcher against the model's {mgr.vocab_size}-token vocabulary, one "
          f"thread, nothing cached), {len(schemas)} schemas of tests/structured_cases.json_schemas(200), "
          f"grammar text {min(texts)}-{max(texts)} bytes:")
    print(f"  P50 {1e3 * percentile(times, 0.5):.2f} ms, P99 {1e3 * percentile(times, 0.99):.2f} ms, "
          f"max {1e3 * max(times):.2f} ms, mean {1e3 * statistics.fmean(times):.2f} ms  {env_str()}")
    print(f"  llguidance tokenizer view: {'built earlier' if had else f'built in {tok_s:.2f} s (once per engine)'}")
    if others:
        print("    " + others)
    return {"p50_ms": 1e3 * percentile(times, 0.5), "p99_ms": 1e3 * percentile(times, 0.99)}


def ttft(llm, prompt, so) -> float:
    from tokenmill import SamplingParams

    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=1.0, seed=0, max_tokens=1,
                                                                    structured_outputs=so), use_tqdm=False)[0]
    return out.metrics.first_token_time - out.metrics.arrival_time


def part_c(llm, args) -> dict:
    import structured_cases as sc

    from tokenmill import StructuredOutputsParams

    tok = llm.get_tokenizer()
    prompt = chat_prompts(tok, 1)[0]
    mgr = llm.engine.core.structured
    # Fresh schemas: a seed json_schemas(200) in (b) did not use, the largest grammars of a batch of candidates.
    pool = sorted(sc.json_schemas(40, seed=12345), key=sc.max_json_chars)[-args.ttft_schemas:]
    cold, warm, plain, compile_s, spins = [], [], [], [], []
    ttft(llm, prompt, None)  # warm-up
    watch = OtherLoad()
    for i, s in enumerate(pool):
        s = {**s, "title": f"fresh-{i}-{time.time_ns()}"}  # never compiled before, whatever ran earlier
        so = StructuredOutputsParams(json=s)
        assert so.spec() not in mgr._cache
        compiles, steps = mgr.stats.compiles, llm.engine.stats.steps
        cold.append(ttft(llm, prompt, so))
        assert mgr.stats.compiles == compiles + 1
        compile_s.append(mgr.stats.compile_s[-1])
        spins.append(llm.engine.stats.steps - steps - 1)  # engine steps beyond the one that computed the token
        hits = mgr.stats.cache_hits
        warm.append(ttft(llm, prompt, StructuredOutputsParams(json=s)))
        assert mgr.stats.cache_hits == hits + 1
        plain.append(ttft(llm, prompt, None))
    others = warn_if_busy(watch.cores(), "during these runs")
    c, w, p = (statistics.median(x) for x in (cold, warm, plain))
    print(f"\n(c) time to first token, one request ({len(prompt)}-token chat prompt), median of {len(pool)} fresh schemas:")
    print(f"  cold grammar {1e3 * c:.1f} ms, cached grammar {1e3 * w:.1f} ms, unconstrained {1e3 * p:.1f} ms: "
          f"cold/cached {c / w:.2f}x, cached/unconstrained {w / p:.2f}x  {env_str()}")
    print(f"  while a cold grammar compiled ({1e3 * statistics.median(compile_s):.2f} ms median in its thread), the "
          f"engine loop ran {statistics.median(spins):.0f} empty steps (median): compile thread and step loop share "
          f"the GIL (switch interval {1e3 * sys.getswitchinterval():g} ms)")
    if others:
        print("    " + others)
    return {"cold_ms": 1e3 * c, "cached_ms": 1e3 * w, "plain_ms": 1e3 * p}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir or GGUF (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ttft-schemas", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="32 output tokens, 1 round, 3 TTFT schemas")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.quick:
        args.output_len, args.rounds, args.ttft_schemas = 32, 1, 3
    if args.threads:
        torch.set_num_threads(args.threads)

    from tokenmill import LLM

    print(cpu_line())
    print(f"load average at start  {env_str()}")
    t0 = time.perf_counter()
    prompt_room = 128
    blocks = math.ceil(args.num_requests * (prompt_room + args.output_len + 16) / 16) + 8
    llm = LLM(args.model, max_model_len=1024, block_size=16, num_gpu_blocks_override=max(blocks, 1024 // 16 + 1))
    print(f"model {llm.engine.config.model.model}: built in {time.perf_counter() - t0:.1f} s, vocabulary "
          f"{llm.engine.vocab_size}, KV cache {llm.engine.kv.num_blocks} blocks of 16 (every request fits at once)")
    b = part_b(llm, args)  # first: it also times the one-off tokenizer view
    a = part_a(llm, args)
    c = part_c(llm, args)
    print(f"\nsummary  {env_str()}")
    print(f"  decode step json_schema / unconstrained: {a['ratio']:.3f}x (target <= 1.10x; "
          f"{a['ratio_same_forward']:.3f}x with equal forward time), grammar {a['grammar_ms']:.3f} ms and "
          f"{a['added_ms']:.2f} ms in all per step of {args.num_requests}")
    print(f"  compile P50 {b['p50_ms']:.2f} ms, P99 {b['p99_ms']:.2f} ms")
    print(f"  TTFT cold {c['cold_ms']:.1f} ms / cached {c['cached_ms']:.1f} ms = {c['cold_ms'] / c['cached_ms']:.2f}x; "
          f"cached / unconstrained {c['cached_ms'] / c['plain_ms']:.2f}x")
    llm.engine.shutdown()


if __name__ == "__main__":
    main()
