"""Multi-LoRA serving against the base model, side by side in one process, on the embedded SmolLM2 (or --model):

- base: R requests (random-id prompts of --prompt-len tokens, --output-len out, EOS ignored) on the base model,
  LoRA off;
- lora: the same requests spread over A adapters (random PEFT adapters of rank --rank on q/k/v/o/gate/up/down,
  written for the model's shapes), all in one batch (--max-loras A);
- lora-torch: the same on the portable delta path (per-adapter GEMMs) instead of the native kernel;
- merged: what serving each adapter merged into its own copy of the model costs: those models have the base's
  shapes and cost, so it is the base engine serving each adapter's R/A requests in turn, one group after another.

Prints output tok/s of each, lora / base (the issue's bar: >= 0.8x) and lora / merged, and the time the LoRA
deltas take per step on each path (the layers' delta calls timed in separate profiled runs). Rounds alternate
the runs, so drift on a shared machine hits all alike; the best round of each counts.

    python benchmarks/lora.py                      # 64 requests over 4 adapters, rank 16
    python benchmarks/lora.py --requests 32 --adapters 8 --max-loras 4 --rank 8
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from measure import env_str  # noqa: E402
from tokenmill import LLM, LoRARequest, SamplingParams  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(path: str, shapes: dict[str, tuple[int, int]], num_layers: int, rank: int, seed: int) -> str:
    """A random PEFT adapter for a model with these projection shapes (no transformers model needed)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(num_layers):
        for part in TARGETS:
            n_in, n_out = shapes[part]
            block = "self_attn" if part in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{block}.{part}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.02
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}, f)
    return path


def run(llm: LLM, prompts, sp, loras) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False, lora_request=loras)
    dt = time.perf_counter() - t0
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def delta_seconds(llm: LLM, prompts, sp, loras) -> tuple[float, int]:
    """Time inside the LoRA delta calls over one run, and the steps it took."""
    layers = [layer.lora for layer in llm.engine.runner.lora.targets.layers.values()]
    spent = [0.0]  # wall time inside the layers' delta calls
    originals = [(lora, lora.add_delta) for lora in layers]

    def timed(fn):
        def wrapper(x, y):
            t = time.perf_counter()
            out = fn(x, y)
            spent[0] += time.perf_counter() - t
            return out
        return wrapper

    for lora, fn in originals:
        lora.add_delta = timed(fn)
    steps0 = llm.engine.stats.steps
    try:
        run(llm, prompts, sp, loras)
    finally:
        for lora, fn in originals:
            lora.add_delta = fn
    steps = (llm.engine.stats.steps) - steps0
    return spent[0], steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: the embedded SmolLM2)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--max-loras", type=int, default=None, help="slots (default: --adapters)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    args = ap.parse_args()

    common = dict(max_model_len=args.prompt_len + args.output_len + 16, max_num_seqs=args.max_num_seqs,
                  enable_prefix_caching=False)
    base = LLM(args.model, **common)
    lora = LLM(args.model, enable_lora=True, max_loras=args.max_loras or args.adapters, max_lora_rank=args.rank,
               max_cpu_loras=args.adapters, **common)
    f = lora.engine.facts
    work = tempfile.mkdtemp(prefix="tokenmill-lora-bench-")
    requests = [LoRARequest(f"adapter{i}", i + 1, write_adapter(os.path.join(work, f"a{i}"), f.lora_shapes,
                                                                 f.num_layers, args.rank, seed=i))
                for i in range(args.adapters)]
    g = torch.Generator().manual_seed(0)
    vocab = base.engine.vocab_size
    prompts = [torch.randint(10, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]
    loras = [requests[i % args.adapters] for i in range(args.requests)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    groups = [[p for p, lr in zip(prompts, loras) if lr is r] for r in requests]

    run(base, prompts[:4], sp, None)  # warm-up: first-call costs out of the timed rounds
    run(lora, prompts[:4], sp, loras[:4])
    layers = [layer.lora for layer in lora.engine.runner.lora.targets.layers.values()]
    native = layers[0].native

    def use_native(on: bool) -> None:
        for layer in layers:
            layer.native = on

    best = {"base": 0.0, "lora": 0.0, "lora-torch": 0.0, "merged": 0.0}
    for rnd in range(args.rounds):
        dt, n = run(base, prompts, sp, None)
        best["base"] = max(best["base"], n / dt)
        dt, n = run(lora, prompts, sp, loras)
        best["lora"] = max(best["lora"], n / dt)
        if native:
            use_native(False)
            dt, n = run(lora, prompts, sp, loras)
            best["lora-torch"] = max(best["lora-torch"], n / dt)
            use_native(True)
        total_t, total_n = 0.0, 0
        for grp in groups:
            dt, n = run(base, grp, sp, None)
            total_t, total_n = total_t + dt, total_n + n
        best["merged"] = max(best["merged"], total_n / total_t)
        print(f"round {rnd}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in best.items()) + f" {env_str()}")
    profiled = {}
    for on in ([True, False] if native else [False]):
        use_native(on)
        profiled["native kernel" if on else "torch path"] = delta_seconds(lora, prompts, sp, loras)
    use_native(native)
    print(f"\n{args.requests} requests over {args.adapters} adapters (rank {args.rank}, {lora.engine.config.lora.max_loras}"
          f" slots), prompts {args.prompt_len}, {args.output_len} out, best of {args.rounds}:")
    print(f"  base model       {best['base']:7.1f} tok/s")
    print(f"  LoRA, mixed      {best['lora']:7.1f} tok/s = {best['lora'] / best['base']:.2f}x base "
          f"({'native kernel' if native else 'torch path'})")
    if native:
        print(f"  LoRA, torch path {best['lora-torch']:7.1f} tok/s = {best['lora-torch'] / best['base']:.2f}x base")
    print(f"  merged, in turn  {best['merged']:7.1f} tok/s; LoRA mixed = {best['lora'] / best['merged']:.2f}x merged")
    for path, (spent, steps) in profiled.items():
        print(f"  LoRA deltas, {path}: {spent:.2f} s over {steps} steps = {1e3 * spent / max(steps, 1):.1f} ms per step")
    print(f"  {env_str()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
