"""Tensor parallelism on this machine: TP=2 (two processes, one thread each, gloo) vs TP=1 (one process,
one thread, and one process with two threads), per-token decode time and the share of each step spent in
all-reduce / all-gather. Ratios from one run.

    python benchmarks/parallel.py                       # a random 110M Llama, batch 1 and 16
    python benchmarks/parallel.py --model path/to/hf --batch 1 --batch 32

SmolLM2 has 9 attention heads, which do not split over 2 ranks (as in vLLM), so the default model is a
random Llama of similar size with 8 heads (hidden 512, 16 layers, 4 KV heads), written to a temp folder.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from measure import env_str  # noqa: E402


def run(model: str | None, tp: int, threads: int | None, batch: int, tokens: int, quantization: str | None) -> dict:
    import torch

    from tokenmill import LLM, SamplingParams

    if threads is not None:
        torch.set_num_threads(threads)
    kw = dict(kv_cache_memory_bytes=256 << 20, max_model_len=1024, tensor_parallel_size=tp)
    if quantization:
        kw["quantization"] = quantization
    llm = LLM(model, **kw)
    try:
        prompts = [[100 + (7 * i + j) % 5000 for j in range(64)] for i in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=2), use_tqdm=False)
        core = llm.engine.core
        core.stats.history.clear()
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t
        decode = [s for s in core.stats.history if s.num_tokens == s.num_requests]  # decode-only steps
        step_s = sum(s.busy_s for s in decode) / max(len(decode), 1)
        coll = sum(s.collective_s for s in decode) / max(len(decode), 1)
        return {"step_ms": 1e3 * step_s, "collective_share": coll / step_s if step_s else 0.0,
                "tok_s": batch * tokens / wall}
    finally:
        llm.engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder (default: a random 110M Llama, see above)")
    ap.add_argument("--batch", type=int, action="append", help="decode batch sizes (default 1 and 16)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--quantization", default="none", help="weights (default none: float32, as TP shards them)")
    args = ap.parse_args()
    print(env_str())
    if args.model is None:
        import tempfile

        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        from tiny import make_tiny_model

        args.model = str(make_tiny_model(tempfile.mkdtemp(prefix="tp-bench-"), "llama", hidden_size=512,
                                         intermediate_size=1536, num_hidden_layers=16, num_attention_heads=8,
                                         num_key_value_heads=4, max_position_embeddings=2048))
    for batch in args.batch or [1, 16]:
        one = run(args.model, 1, 1, batch, args.tokens, args.quantization)
        two_threads = run(args.model, 1, 2, batch, args.tokens, args.quantization)
        tp2 = run(args.model, 2, None, batch, args.tokens, args.quantization)
        print(f"batch {batch}: decode step TP=1 x 1 thread {one['step_ms']:.1f} ms, TP=1 x 2 threads "
              f"{two_threads['step_ms']:.1f} ms, TP=2 x 1 thread {tp2['step_ms']:.1f} ms "
              f"(all-reduce/all-gather {100 * tp2['collective_share']:.0f}% of the step); TP=2 vs TP=1 x 1 thread "
              f"{one['step_ms'] / tp2['step_ms']:.2f}x, vs TP=1 x 2 threads {two_threads['step_ms'] / tp2['step_ms']:.2f}x")
    print("load average after:", open("/proc/loadavg").read().split()[:3])


if __name__ == "__main__":
    main()
