"""Perplexity of the embedded SmolLM2 (or --model) on a fixed local text, per weight / KV-cache format:
the text is CPython's pydoc_data/topics.py help strings (shipped with every Python; ~100k SmolLM2 tokens
at --max-tokens 100000), cut into windows of --window tokens, each scored from its own start (the first
token of a window is not scored), through `prompt_logprobs` with chunked prefill so the attention reads
earlier tokens back from the (possibly quantized) KV cache.

    python benchmarks/quality.py                                   # all formats, 100k tokens
    python benchmarks/quality.py --max-tokens 16384 --configs float32,int8,kv-int8

Prints a Markdown table: perplexity, its change against float32 and the bar issue #12 sets.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from measure import env_str  # noqa: E402
from quantized_decode import embedded_model  # noqa: E402

# label -> (LLM keyword arguments, allowed relative increase over float32 or None)
CONFIGS = {
    "float32": (dict(quantization="none"), None),
    "int8": (dict(quantization="int8"), 0.01),
    "int4-g32": (dict(quantization="int4", quantization_group_size=32), 0.05),
    "int4-g64": (dict(quantization="int4", quantization_group_size=64), None),  # 128 does not divide 576
    "gguf-q4_1": (dict(), None),
    # int8 activations: every row of x, prefill chunks included
    "gguf-q4_1-x8": (dict(activation_quantization="int8"), None),
    "int8-x8": (dict(quantization="int8", activation_quantization="int8"), None),
    "int8-w8a8": (dict(quantization="int8", activation_quantization="int8_per_token"), None),
    "int4-g32-x8": (dict(quantization="int4", quantization_group_size=32, activation_quantization="int8"), None),
    "kv-int8": (dict(quantization="none", kv_cache_dtype="int8"), 0.005),
    "kv-fp8": (dict(quantization="none", kv_cache_dtype="fp8_e4m3"), None),
}


def corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def perplexity(llm, windows: list[list[int]]) -> float:
    from tokenmill import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate(windows, sp, use_tqdm=False)
    nll, n = 0.0, 0
    for o, ids in zip(outs, windows):
        for pos, entry in enumerate(o.prompt_logprobs):
            if entry is None:
                continue
            nll -= entry[ids[pos]].logprob
            n += 1
    return math.exp(nll / n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--max-tokens", type=int, default=100_000)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens: prompt chunk per step")
    args = ap.parse_args()
    from tokenmill import LLM

    model = args.model or embedded_model()
    labels = [c for c in args.configs.split(",") if c]
    results = {}
    ids = None
    for c in labels:
        kw, _ = CONFIGS[c]
        llm = LLM(model, max_model_len=args.window + 8, max_num_batched_tokens=args.chunk,
                  enable_prefix_caching=False, **kw)
        if ids is None:
            ids = llm.get_tokenizer()(corpus(), add_special_tokens=False).input_ids[: args.max_tokens]
            windows = [ids[i : i + args.window] for i in range(0, len(ids) - 1, args.window)]
            windows = [w for w in windows if len(w) > 1]
            print(f"{len(ids)} tokens in {len(windows)} windows of {args.window} {env_str()}")
        t = time.perf_counter()
        results[c] = perplexity(llm, windows)
        print(f"{c}: perplexity {results[c]:.4f} ({time.perf_counter() - t:.0f} s) {env_str()}", flush=True)
        del llm
    ref = results.get("float32")
    print("\n| format | perplexity | vs float32 | bar |")
    print("|---|---|---|---|")
    for c in labels:
        bar = CONFIGS[c][1]
        rel = "" if ref is None else f"{results[c] / ref - 1:+.2%}"
        ok = "" if bar is None or ref is None else (f"<= +{bar:.1%}: " + ("met" if results[c] / ref - 1 <= bar else "MISSED"))
        print(f"| {c} | {results[c]:.4f} | {rel} | {ok} |")


if __name__ == "__main__":
    main()
