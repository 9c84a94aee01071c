"""Offline throughput, side by side in one process: tokenmill vs transformers `generate` (padded
batches) vs transformers continuous batching (`generate_batch`), same prompts, same number of
output tokens, greedy, float32 compute. Also: load time (cold and warm), batch-1 decode speed against
this machine's memory-bandwidth roofline.

    python benchmarks/throughput.py                 # embedded SmolLM2-135M-Instruct
    python benchmarks/throughput.py --model DIR_OR_GGUF --num-prompts 64 --output-len 64
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch


def make_prompts(tokenizer, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    words = ("the model serves many users at once with paged attention and continuous batching of "
             "requests while the scheduler keeps a token budget for every step of the engine loop").split()
    prompts = []
    for _ in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        idx = torch.randint(0, len(words), (length,), generator=g).tolist()
        ids = tokenizer(" ".join(words[i] for i in idx)).input_ids[:length]
        prompts.append(ids)
    return prompts


def measure_load(model: str, cache: str) -> float:
    """Seconds from a fresh interpreter to a ready engine (imports included)."""
    import subprocess

    code = ("import time; t = time.perf_counter(); from tokenmill import LLM; "
            f"LLM({model!r}, max_model_len=1024, kv_cache_memory_bytes=64 << 20); print(time.perf_counter() - t)")
    env = dict(os.environ, TOKENMILL_CACHE=cache)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def measure_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s for streaming reads of a large fp32 tensor (what a weight-bound decode does)."""
    x = torch.ones(nbytes // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def run_tokenmill(model: str, prompts, output_len: int, block_size: int):
    from tokenmill import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(model, max_model_len=max(len(p) for p in prompts) + output_len + 16, block_size=block_size,
              kv_cache_memory_bytes=1 << 30, max_num_batched_tokens=1024)
    load = time.perf_counter() - t
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return llm, load, n / dt, outs


def batch1_decode(llm, prompt, output_len: int) -> float:
    from tokenmill import SamplingParams

    e = llm.engine
    e.add_request("b1", prompt, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
    e.step()  # prefill + first token
    t = time.perf_counter()
    steps = 0
    while e.has_unfinished_requests():
        e.step()
        steps += 1
    return steps / (time.perf_counter() - t)


def hf_model(model: str):
    import transformers as tf

    t = time.perf_counter()
    if model.endswith(".gguf"):
        folder, name = os.path.split(model)
        m = tf.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    else:
        m = tf.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    return m.eval(), time.perf_counter() - t


@torch.inference_mode()
def run_hf_padded(m, prompts, output_len: int, batch: int = 16, pad_id: int = 0) -> float:
    t = time.perf_counter()
    n = 0
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(chunk):  # left padding
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        out = m.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                         do_sample=False, pad_token_id=pad_id)
        n += (out.shape[1] - width) * len(chunk)
    return n / (time.perf_counter() - t)


@torch.inference_mode()
def run_hf_continuous(m, prompts, output_len: int) -> float:
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                           eos_token_id=-1, pad_token_id=0)
    m.generate_batch(inputs=prompts[:2], generation_config=cfg, max_new_tokens=4)  # warm-up
    t = time.perf_counter()
    res = m.generate_batch(inputs=prompts, generation_config=cfg)
    dt = time.perf_counter() - t
    n = sum(len(r.generated_tokens) for r in res.values())
    return n / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len-min", type=int, default=32)
    ap.add_argument("--input-len-max", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true", help="tokenmill only")
    args = ap.parse_args()

    from tokenmill.model.default import resolve_model
    from tokenmill.model.loader import load_tokenizer

    model = resolve_model(args.model)
    print(f"model: {model}\ntorch threads: {torch.get_num_threads()}")

    # Cold: a fresh tokenizer cache (GGUF vocabulary converted); warm: the converted tokenizer is reused.
    with tempfile.TemporaryDirectory() as cache:
        cold = measure_load(model, cache)
        warm = measure_load(model, cache)
    print(f"tokenmill load (fresh process, imports included): cold {cold:.1f} s, warm {warm:.1f} s")
    tok = load_tokenizer(model)
    prompts = make_prompts(tok, args.num_prompts, args.input_len_min, args.input_len_max)
    llm, _, tm_tps, _ = run_tokenmill(model, prompts, args.output_len, args.block_size)

    bw = measure_bandwidth()
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
    b1 = batch1_decode(llm, prompts[0], args.output_len)
    roofline = bw / weight_bytes
    print(f"memory bandwidth (streaming read): {bw / 1e9:.1f} GB/s; weights {weight_bytes / 1e6:.0f} MB")
    print(f"batch-1 decode: {b1:.1f} tok/s = {100 * b1 / roofline:.0f}% of the bandwidth roofline ({roofline:.1f} tok/s)")
    print(f"tokenmill: {tm_tps:.1f} output tok/s ({args.num_prompts} requests x {args.output_len} tokens)")
    del llm
    if args.skip_hf:
        return
    m, hf_load = hf_model(model)
    print(f"transformers load: {hf_load:.1f} s")
    padded = run_hf_padded(m, prompts, args.output_len)
    print(f"transformers generate (padded batches of 16): {padded:.1f} tok/s")
    try:
        cb = run_hf_continuous(m, prompts, args.output_len)
        print(f"transformers generate_batch (continuous batching): {cb:.1f} tok/s")
    except Exception as e:  # noqa: BLE001 - report, don't hide
        cb = None
        print(f"transformers generate_batch failed: {type(e).__name__}: {e}", file=sys.stderr)
    print(f"ratio tokenmill / padded generate: {tm_tps / padded:.2f}x")
    if cb:
        print(f"ratio tokenmill / continuous batching: {tm_tps / cb:.2f}x")
    print(f"load time: transformers {hf_load:.1f} s (in-process, imports done) vs tokenmill warm {warm:.1f} s "
          f"(fresh process): {hf_load / warm:.1f}x")


if __name__ == "__main__":
    main()
