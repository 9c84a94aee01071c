"""Speculative decoding vs none, side by side in one process (ratios, with acceptance beside each figure).

    python benchmarks/speculative.py                 # SmolLM2 (embedded), all three workloads
    python benchmarks/speculative.py --only ngram    # one of: ngram, quantized_self, concurrency, shapes

1. ngram, batch 1, input-grounded prompts (rewrite a given text, edit given code): decode tok/s, with the
   target's weights as GGUF Q4_1 blocks and as float32.
2. quantized_self, batch 1, free generation: the float32 target (the GGUF dequantized) with its own
   int4 weights as the draft, vs the float32 target alone.
3. concurrency 64 (random 128-token prompts, 64 output tokens): throughput with ngram speculation
   enabled (adaptive) vs disabled.
4. shapes (chain vs tree vs block): Medusa heads (`tokenmill train-medusa`), an EAGLE head (`tokenmill
   train-eagle`) and a block drafter (`tokenmill train-dflash`), all trained here on the model's own greedy
   continuations of the prompts shipped with them (or --medusa-heads, --eagle-head, --dflash-drafter DIR);
   Medusa as a chain (each head's top token) and as a tree (the default 16-node tree, its first --tree-nodes
   nodes; fixed, and with the adaptive policy choosing the node budget); EAGLE as a chain of 4 and as EAGLE-2
   trees of --tree-nodes nodes (width 4, fixed and adaptive); the block drafter sending whole blocks of 4, blocks
   cut by its acceptance estimate, and that with the adaptive policy; each vs none, at batch 1 and at
   concurrency 16, on chat prompts that are not in the training set: accepted tokens per verification and tok/s.
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


def run_shapes(args) -> None:
    """Chain vs tree vs block: Medusa heads (chain of each head's top token, the default tree) and a block drafter
    (whole blocks, blocks cut by the acceptance estimate, and the adaptive policy over that), both trained here."""
    import tempfile

    from tokenmill import SamplingParams
    from tokenmill.spec_decode.dflash_train import train_dflash
    from tokenmill.spec_decode.eagle_train import train_eagle
    from tokenmill.spec_decode.medusa_train import PROMPTS, train_medusa

    assert not set(MEDUSA_PROMPTS) & set(PROMPTS), "benchmark prompts must not be training prompts"
    heads_dir, block_dir, eagle_dir = args.medusa_heads, args.dflash_drafter, args.eagle_head
    if heads_dir is None:
        heads_dir = tempfile.mkdtemp(prefix="tokenmill-medusa-")
        r = train_medusa(args.model, heads_dir, heads=4, max_tokens=256, steps=600, lr=1e-3)
        print(f"medusa heads trained in {r.seconds:.0f} s on {r.positions} positions; held-out top-1/top-3: " +
              ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(r.top1, r.top3)))
    if block_dir is None:
        block_dir = tempfile.mkdtemp(prefix="tokenmill-dflash-")
        r = train_dflash(args.model, block_dir, block_size=4, max_tokens=256, steps=600)
        print(f"block drafter trained in {r.seconds:.0f} s on {r.positions} positions; held-out top-1 per position "
              + ", ".join(f"{a:.2f}" for a in r.top1) + f"; accepted prefix {r.accepted:.2f} per block "
              f"(estimated {r.estimated:.2f})")
    if eagle_dir is None:
        eagle_dir = tempfile.mkdtemp(prefix="tokenmill-eagle-")
        r = train_eagle(args.model, eagle_dir, max_tokens=256, steps=400)
        print(f"EAGLE head trained in {r.seconds:.0f} s on {r.positions} positions; held-out top-1 {r.top1:.2f} "
              f"(first draft), {r.top1_second:.2f} (second, on its own feature)")
    chain = [[0] * d for d in range(1, 5)]
    medusa = {"method": "medusa", "model": heads_dir}
    block = {"method": "dflash", "model": block_dir, "num_speculative_tokens": 4}
    eagle = {"method": "eagle", "model": eagle_dir}
    eagle_tree = {**eagle, "num_speculative_tokens": args.tree_nodes, "tree_topk": 4, "tree_depth": 5}
    runs = {"none": None,
            "medusa chain": {**medusa, "num_speculative_tokens": 4, "medusa_choices": chain, "adaptive": False},
            "medusa tree": {**medusa, "num_speculative_tokens": args.tree_nodes, "adaptive": False},
            "medusa tree, adaptive": {**medusa, "num_speculative_tokens": args.tree_nodes},
            "eagle chain": {**eagle, "num_speculative_tokens": 4, "adaptive": False},
            "eagle tree": {**eagle_tree, "adaptive": False},
            "eagle tree, adaptive": eagle_tree,
            "block, whole": {**block, "block_threshold": 0.0, "adaptive": False},
            "block, cut": {**block, "adaptive": False},
            "block, cut, adaptive": block}
    if args.only_runs:
        runs = {k: v for k, v in runs.items() if k == "none" or any(w in k for w in args.only_runs.split(","))}
    names = [n for n in runs if n != "none"]
    # (one request of max_model_len 8192 needs 377 MB of KV on SmolLM2: 512 MiB each keeps ten engines in memory)
    llms = {name: llm_for(args.model, spec, max_num_seqs=16, kv=512 << 20) for name, spec in runs.items()}
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
    for name in names:
        r = sum(rates[name]) / len(rates[name])
        print(f"{name}, batch 1: {base:.1f} -> {r:.1f} tok/s = {r / base:.2f}x; {spec_line(llms[name])}; "
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
            drafted = (after["num_draft_tokens"] - before["num_draft_tokens"]) / d if d else 0.0
            got[name] += (acc, drafted)
    for name in names:
        print(f"{name}, concurrency 16: {got['none'][0]:.1f} -> {got[name][0]:.1f} tok/s = "
              f"{got[name][0] / got['none'][0]:.2f}x; {got[name][2]:.2f} accepted of {got[name][3]:.2f} drafted per "
              f"verification; same tokens: {'yes' if got[name][1] == got['none'][1] else 'NO'}")
    del llms
    gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--only", choices=("ngram", "quantized_self", "concurrency", "shapes"))
    ap.add_argument("--medusa-heads", default=None, help="Medusa folder (default: train heads first, ~2 min)")
    ap.add_argument("--dflash-drafter", default=None, help="block drafter folder (default: train one first, ~5 min)")
    ap.add_argument("--eagle-head", default=None, help="EAGLE head folder (default: train one first)")
    ap.add_argument("--only-runs", default=None, help="shapes: comma-separated words of the runs to keep")
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
                     ("shapes", run_shapes)):
        if args.only in (None, name):
            fn(args)
    print("load average after:", open("/proc/loadavg").read().split()[:3])


if __name__ == "__main__":
    main()
