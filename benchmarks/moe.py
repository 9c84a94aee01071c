"""MoE step time vs a dense model with the same *active* parameters, side by side in one process.

A Mixtral-shaped model with E experts of intermediate I, top-k, against a Llama with intermediate k*I
(same hidden size, layers, attention, vocabulary): each decode token multiplies the same number of
weights in both. Decode steps of batch 1 and of a batch of --batch requests; the figure is the median
forward time of the pure-decode steps (LLMEngine.stats.history), and whole-step time, printed as
MoE / dense ratios (issue 14's bar: MoE <= 1.3x the dense step). At batch 1 the MoE reads k of E
experts (the same bytes as the dense MLP); at larger batches most experts are active, so the MoE reads
up to E/k times the dense MLP's bytes and runs one small GEMM pair per active expert.

    python benchmarks/moe.py                      # hidden 512, 4 layers, 8 experts top-2 of I=512
    python benchmarks/moe.py --hidden 1024 --experts 8 --top-k 2 --intermediate 1024 --batch 32

Both models are built and warmed up before any timed run; --rounds interleave them and the best round
counts. Every line carries the load average and thread count.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from measure import OtherLoad, env_str, warn_if_busy  # noqa: E402


def build(root: Path, args) -> dict[str, Path]:
    from tiny import make_tiny_model

    common = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                  num_key_value_heads=args.heads)
    return {
        "moe": make_tiny_model(root / "moe", "mixtral", num_local_experts=args.experts,
                               num_experts_per_tok=args.top_k, intermediate_size=args.intermediate, **common),
        "dense": make_tiny_model(root / "dense", "llama", intermediate_size=args.top_k * args.intermediate, **common),
    }


def decode_step(llm, batch: int, tokens: int) -> tuple[float, float]:
    """(median forward s, median whole step s) over the pure-decode steps of `batch` requests."""
    from tokenmill import SamplingParams

    prompts = [[5 + (i * 7 + j) % 300 for j in range(16)] for i in range(batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    steps = [s for s in llm.engine.stats.history if s.end_time >= t0 and s.num_tokens == batch == s.num_sampled]
    whole = [s.schedule_s + s.prepare_s + s.forward_s + s.sample_s + s.detokenize_s for s in steps]
    return statistics.median(s.forward_s for s in steps), statistics.median(whole)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=512, help="per expert; the dense model gets top-k times it")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per run")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from tokenmill import LLM

    with tempfile.TemporaryDirectory() as tmp:
        paths = build(Path(tmp), args)
        llms = {k: LLM(str(p), max_model_len=128, num_gpu_blocks_override=args.batch * 4 + 8, block_size=16,
                       max_num_seqs=max(args.batch, 1)) for k, p in paths.items()}
    print(f"MoE: {args.experts} experts top-{args.top_k}, I={args.intermediate}; dense: I={args.top_k * args.intermediate}; "
          f"hidden {args.hidden}, {args.layers} layers {env_str()}")
    for llm in llms.values():  # warm-up
        decode_step(llm, 1, 4)
        decode_step(llm, args.batch, 4)
    for batch in (1, args.batch):
        best: dict[str, tuple[float, float]] = {}
        load = OtherLoad()
        for _ in range(args.rounds):
            for name, llm in llms.items():
                f, w = decode_step(llm, batch, args.tokens)
                b = best.get(name)
                best[name] = (f, w) if b is None else (min(b[0], f), min(b[1], w))
        (mf, mw), (df, dw) = best["moe"], best["dense"]
        print(f"decode batch {batch:>3}: forward moe {mf * 1e3:7.2f} ms  dense {df * 1e3:7.2f} ms  ratio {mf / df:5.2f}x | "
              f"step moe {mw * 1e3:7.2f} ms  dense {dw * 1e3:7.2f} ms  ratio {mw / dw:5.2f}x {env_str()}")
        note = warn_if_busy(load.cores(), "during these rounds")
        if note:
            print("  " + note)
    with open("/proc/loadavg") as f:
        print("/proc/loadavg:", f.read().strip())


if __name__ == "__main__":
    main()
