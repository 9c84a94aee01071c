"""Speculative decoding vs none, side by side in one process (ratios, with acceptance beside each figure).

    python benchmarks/speculative.py                 # SmolLM2 (embedded), all three workloads
    python benchmarks/speculative.py --only ngram    # one of: ngram, quantized_self, concurrency

1. ngram, batch 1, input-grounded prompts (rewrite a given text, edit given code): decode tok/s, with the
   target's weights as GGUF Q4_1 blocks and as float32.
2. quantized_self, batch 1, free generation: the float32 target (the GGUF dequantized) with its own
   int4 weights as the draft, vs the float32 target alone.
3. concurrency 64 (random 128-token prompts, 64 output tokens): throughput with ngram speculation
   enabled (adaptive) vs disabled.
4. medusa: heads trained by `tokenmill train-medusa` on the model's own greedy continuations of the prompts
   shipped with it (or --medusa-heads DIR), then chain (each head's top token) vs tree (the default 16-node
   tree, its first --tree-nodes nodes; fixed, and with the adaptive policy choosing the node budget) vs none, at
   batch 1 and at concurrency 16, on chat prompts that are not in the training set: accepted tokens per
   verification and tok/s.
Greedy throughout; every run's tokens are compared with the run without speculation.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from measure import env_str  # noqa: E402

TEXT = ("Paged attention stores the keys and values of every request in fixed-size blocks, so memory is "
        "allocated as a sequence grows and freed the moment it finishes. Continuous batching schedules new "
        "tokens for every running request at each step, which keeps the hardware busy while requests of "
        "different lengths come and go. Prefix caching lets requests that share a system prompt reuse the "
        "blocks computed for the first one.")
CODE = '''def total_price(items, tax):
    total = 0
    for item in items:
        total = total + item.price * item.quantity
    total = total + total * tax
    return total


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
'''
GROUNDED = [
    f"Rewrite the following text in your own words, keeping every fact:\n\n{TEXT}",
    f"Repeat this text exactly, then say how many sentences it has:\n\n{TEXT}",
    f"Add a docstring to each function and rename `items` to `products`. Return the whole code.\n\n{CODE}",
]
FREE = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain how a bicycle works to a ten-year-old."]


def llm_for(model: str | None, spec: dict | None, **kw):
    from tokenmill import LLM

    return LLM(model, speculative_config=spec, kv_cache_memory_bytes=kw.pop("kv", 1 << 30), **kw)


def chat_ids(llm, text: str) -> list[int]:
    tok = llm.get_tokenizer()
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False)


def batch1(llm, prompt_ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Decode tok/s of one request (after its first token) and its tokens."""
    from tokenmill import SamplingParams

    e = llm.engine
    rid = f"b1-{time.monotonic_ns()}"
    e.add_request(rid, None, SamplingParams(temperature=0.0, max_tokens=max_tokens), prompt_token_ids=prompt_ids)
    outs = e.step()
    first = len(outs[0].outputs[0].token_ids) if outs else 0
    t = time.perf_counter()
    final = outs
    while e.has_unfinished_requests():
        got = e.step()
        final = got or final
    dt = time.perf_counter() - t
    tokens = final[0].outputs[0].token_ids
    return (len(tokens) - first) / dt if dt > 0 else 0.0, list(tokens)


def spec_line(llm) -> str:
    s = llm.engine.core.scheduler.spec_stats.as_dict()
    if not s["num_drafts"]:
        return "no drafts verified"
    return (f"acceptance {s['acceptance_rate']:.2f}, mean accepted length {s['mean_acceptance_length']:.2f}, "
            f"{s['num_drafts']} verifications")


def compare_batch1(label: str, base, spec, prompts: list[list[int]], max_tokens: int, rounds: int) -> None:
    rates = {"off": [], "on": []}
    same = True
    for ids in prompts:
        best = {}
        for _ in range(rounds):
            for key, llm in (("off", base), ("on", spec)):
                r, toks = batch1(llm, ids, max_tokens)
                if r > best.get(key, (0, None))[0]:
                    best[key] = (r, toks)
        same &= best["off"][1] == best["on"][1]
        rates["off"].append(best["off"][0])
        rates["on"].append(best["on"][0])
        print(f"  prompt of {len(ids)} tokens: {best['off'][0]:6.1f} -> {best['on'][0]:6.1f} tok/s "
              f"({best['on'][0] / best['off'][0]:.2f}x)")
    off, on = sum(rates["off"]) / len(prompts), sum(rates["on"]) / len(prompts)
    print(f"{label}: {off:.1f} -> {on:.1f} tok/s = {on / off:.2f}x; {spec_line(spec)}; "
          f"same tokens: {'yes' if same else 'NO'}")


def run_ngram(args) -> None:
    for quant in args.ngram_targets.split(","):
        base = llm_for(args.model, None, quantization=quant)
        spec = llm_for(args.model, {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2,
                                    "prompt_lookup_max": 4}, quantization=quant)
        prompts = [chat_ids(base, p) for p in GROUNDED]
        compare_batch1(f"ngram, batch 1, input-grounded, target weights {quant}", base, spec, prompts,
                       args.max_tokens, args.rounds)
        del base, spec
        gc.collect()


def run_quantized_self(args) -> None:
    base = llm_for(args.model, None, quantization="none")
    spec = llm_for(args.model, {"method": "quantized_self", "num_speculative_tokens": args.k},
                   quantization="none")
    prompts = [chat_ids(base, p) for p in FREE]
    compare_batch1("quantized_self (int4 draft, float32 target), batch 1, free generation", base, spec, prompts,
                   args.max_tokens, args.rounds)
    del base, spec
    gc.collect()


def run_concurrency(args) -> None:
    import random

    from tokenmill import SamplingParams

    n = args.concurrency
    rng = random.Random(0)
    base = llm_for(args.model, None, max_num_seqs=n)
    vocab = base.get_tokenizer().vocab_size
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(128)] for _ in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    spec = llm_for(args.model, {"method": "ngram", "num_speculative_tokens": args.k}, max_num_seqs=n)
    best = {}
    for _ in range(args.rounds):
        for key, llm in (("off", base), ("on", spec)):
            t = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            rate = sum(len(o.outputs[0].token_ids) for o in out) / (time.perf_counter() - t)
            if rate > best.get(key, (0, None))[0]:
                best[key] = (rate, [o.outputs[0].token_ids for o in out])
    k = spec.engine.core.executor.worker.runner.spec.last_k
    print(f"concurrency {n}, ngram adaptive: {best['off'][0]:.1f} -> {best['on'][0]:.1f} tok/s = "
          f"{best['on'][0] / best['off'][0]:.2f}x; {spec_line(spec)}; k at the end {k}; "
          f"same tokens: {'yes' if best['off'][1] == best['on'][1] else 'NO'}")


MEDUSA_PROMPTS = FREE + [
    "Describe how a refrigerator keeps food cold.", "Write a poem about the moon.",
    "What should I pack for a week of hiking?", "Explain the difference between a virus and a bacterium.",
    "Give three reasons to learn a second language.", "How do bees make honey?",
    "Write a short dialogue between a cat and a dog.", "What is the history of the bicycle?",
    "Explain what an operating system does.", "Describe a busy market in the morning.",
    "How do rainbows form?", "Write instructions for planting a tree.", "What makes a good friend?",
    "Explain how a compass works."]


def run_medusa(args) -> None:
    import tempfile

    from tokenmill import SamplingParams
    from tokenmill.spec_decode.medusa_train import PROMPTS, train_medusa

    assert not set(MEDUSA_PROMPTS) & set(PROMPTS), "benchmark prompts must not be training prompts"
    heads_dir = args.medusa_heads
    if heads_dir is None:
        heads_dir = tempfile.mkdtemp(prefix="tokenmill-medusa-")
        r = train_medusa(args.model, heads_dir, heads=4, max_tokens=256, steps=600, lr=1e-3)
        print(f"medusa heads trained in {r.seconds:.0f} s on {r.positions} positions; held-out top-1/top-3: " +
              ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(r.top1, r.top3)))
    chain = [[0] * d for d in range(1, 5)]
    runs = {"none": None,
            "chain": {"method": "medusa", "model": heads_dir, "num_speculative_tokens": 4, "medusa_choices": chain,
                      "adaptive": False},
            "tree": {"method": "medusa", "model": heads_dir, "num_speculative_tokens": args.tree_nodes,
                     "adaptive": False},
            "tree, adaptive": {"method": "medusa", "model": heads_dir, "num_speculative_tokens": args.tree_nodes}}
    llms = {name: llm_for(args.model, spec, max_num_seqs=16) for name, spec in runs.items()}
    prompts = [chat_ids(llms["none"], p) for p in MEDUSA_PROMPTS]
    # batch 1
    rates = {name: [] for name in runs}
    tokens = {name: [] for name in runs}
    for ids in prompts[:4]:
        for name, llm in llms.items():
            best = max((batch1(llm, ids, args.max_tokens) for _ in range(args.rounds)), key=lambda x: x[0])
            rates[name].append(best[0])
            tokens[name].append(best[1])
    base = sum(rates["none"]) / len(rates["none"])
    for name in ("chain", "tree", "tree, adaptive"):
        r = sum(rates[name]) / len(rates[name])
        print(f"medusa {name}, batch 1: {base:.1f} -> {r:.1f} tok/s = {r / base:.2f}x; {spec_line(llms[name])}; "
              f"same tokens: {'yes' if tokens[name] == tokens['none'] else 'NO'}")
    # concurrency 16
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    batch = [{"prompt_token_ids": p} for p in prompts[:16]]
    got = {}
    for name, llm in llms.items():
        before = llm.engine.core.scheduler.spec_stats.as_dict() if name != "none" else None
        best = (0.0, None)
        for _ in range(args.rounds):
            t = time.perf_counter()
            out = llm.generate(batch, params, use_tqdm=False)
            rate = sum(len(o.outputs[0].token_ids) for o in out) / (time.perf_counter() - t)
            if rate > best[0]:
                best = (rate, [o.outputs[0].token_ids for o in out])
        got[name] = best
        if before is not None:
            after = llm.engine.core.scheduler.spec_stats.as_dict()
            d = after["num_drafts"] - before["num_drafts"]
            acc = (after["num_accepted_tokens"] - before["num_accepted_tokens"]) / d if d else 0.0
            got[name] += (acc,)
    for name in ("chain", "tree", "tree, adaptive"):
        print(f"medusa {name}, concurrency 16: {got['none'][0]:.1f} -> {got[name][0]:.1f} tok/s = "
              f"{got[name][0] / got['none'][0]:.2f}x; {got[name][2]:.2f} accepted per verification; "
              f"same tokens: {'yes' if got[name][1] == got['none'][1] else 'NO'}")
    del llms
    gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--only", choices=("ngram", "quantized_self", "concurrency", "medusa"))
    ap.add_argument("--medusa-heads", default=None, help="Medusa folder (default: train heads first, ~2 min)")
    ap.add_argument("--tree-nodes", type=int, default=16, help="medusa tree: nodes verified per step")
    ap.add_argument("-k", type=int, default=4, help="num_speculative_tokens (default 4)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="best of this many runs per figure")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--ngram-targets", default="gguf,none",
                    help="target weight formats for the ngram runs: gguf (Q4_1 blocks), none (float32)")
    args = ap.parse_args()
    print(env_str())
    for name, fn in (("ngram", run_ngram), ("quantized_self", run_quantized_self), ("concurrency", run_concurrency),
                     ("medusa", run_medusa)):
        if args.only in (None, name):
            fn(args)
    print("load average after:", open("/proc/loadavg").read().split()[:3])


if __name__ == "__main__":
    main()
