"""Offline throughput, side by side in one process: tokenmill (once per attention backend) vs
transformers `generate` (padded batches) vs transformers continuous batching (`generate_batch`), same
prompts, same number of output tokens, greedy, float32 compute. Also: load time (cold and warm),
batch-1 decode speed against this machine's memory-bandwidth roofline, and for every tokenmill run
where its time went (prefill, decode GEMM+rest, decode attention, sampling, overhead).

    python benchmarks/throughput.py                 # embedded SmolLM2-135M-Instruct, default backend
    python benchmarks/throughput.py --model DIR_OR_GGUF --num-prompts 64 --output-len 64

    # Issue 10's workload: 64 requests, prompts of 32-512 random token ids, 128 output tokens, greedy,
    # EOS ignored, float32, every attention backend vs transformers padded generate, all in one process:
    python benchmarks/throughput.py --attention-backend torch_sdpa,cpu_paged --random-ids \\
        --num-prompts 64 --input-len-min 32 --input-len-max 512 --output-len 128 --ignore-eos \\
        --hf-modes padded --skip-load --skip-batch1

    # Issue 10's long context: 4 requests x 8k-token prompts (clamped to max_position_embeddings minus
    # the output: 8064 on SmolLM2) decoding 128 tokens; per-token decode time and attention share:
    python benchmarks/throughput.py --long-context --attention-backend torch_sdpa,cpu_paged

    # smoke test
    python benchmarks/throughput.py --num-prompts 4 --output-len 4 --random-ids --skip-load --hf-modes padded

--attention-backend is repeatable or a comma list (default: the device's default backend); each
backend gets its own LLM, built before any timed run, so rounds (--rounds) interleave the backends
and drift on a shared machine hits them alike. The prefix cache is reset before every timed run (the
warm-up's prompts would otherwise hit it). The KV cache is sized to hold every request at once
(--kv-cache-memory-bytes overrides), so no request waits for blocks or is preempted.

The phase split comes from the engine's per-step stats (LLMEngine.stats.history, tokenmill/engine/
stats.py): "prefill" is the forward time of steps that carry prompt tokens (steps mixing prompt chunks
and decodes included), "decode GEMM+rest" and "decode attention" split the forward time of decode-only
steps by the time spent inside the attention backend (StepStats.attn_s; where the engine has no
attention timing the decode forward is shown whole), "sampling" is every step's sampling, and
"overhead" is the rest of the wall time (scheduling, input preparation, detokenizing, the LLM loop).
Attention's achieved K/V read rate is StepStats.attn_bytes / attn_s (or kv_tokens, the sum of context
lengths, x KV bytes per token without attn_bytes) against the streaming read bandwidth measured at start. Every figure line carries
os.getloadavg() and torch's thread count, and every timed run says how many cores other processes
used meanwhile (from /proc/stat), with a warning when they competed with torch's threads: the machine
may be shared, and a busy core makes every OpenMP region wait for a scheduler tick.

--long-context: 4 requests (--num-prompts) of random ids, --input-len-max tokens (default 8192,
clamped to the model's max_position_embeddings minus --output-len), --output-len 128 by default; per
backend: prefill time, then over the decode steps where every request decodes: ms per step (each
request gets one token per step), output tok/s, attention ms per step and its share of the step, and
attention's achieved GB/s. No transformers run in this mode.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

import torch

from measure import OtherLoad, env, env_str, measure_bandwidth, warn_if_busy


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


def make_random_id_prompts(tokenizer, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """Prompts of exactly uniform(lo, hi) random token ids, special tokens excluded."""
    g = torch.Generator().manual_seed(seed)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    allowed = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    prompts = []
    for _ in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        prompts.append(allowed[torch.randint(0, len(allowed), (length,), generator=g)].tolist())
    return prompts


def model_max_len(model: str) -> int:
    """The model's max_position_embeddings, as tokenmill's loader reads it."""
    from tokenmill.model.loader import is_gguf, load_hf_config

    if is_gguf(model):
        from tokenmill.model.gguf_loader import hf_config_from_gguf

        cfg = hf_config_from_gguf(model)
    else:
        cfg = load_hf_config(model)
    return int(getattr(cfg, "max_position_embeddings", 0) or 0) or 2048


def measure_load(model: str, cache: str) -> float:
    """Seconds from a fresh interpreter to a ready engine (imports included)."""
    import subprocess

    code = ("import time; t = time.perf_counter(); from tokenmill import LLM; "
            f"LLM({model!r}, max_model_len=1024, kv_cache_memory_bytes=64 << 20); print(time.perf_counter() - t)")
    env_ = dict(os.environ, TOKENMILL_CACHE=cache)
    out = subprocess.run([sys.executable, "-c", code], env=env_, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


# ---- tokenmill ----------------------------------------------------------------------------------
def build_llm(model: str, backend: str | None, max_model_len: int, num_blocks: int | None, args):
    from tokenmill import LLM, SamplingParams

    kw = dict(max_model_len=max_model_len, block_size=args.block_size, dtype=args.dtype,
              kv_cache_dtype=args.kv_cache_dtype, max_num_batched_tokens=args.max_num_batched_tokens)
    if backend:
        kw["attention_backend"] = backend
    if args.kv_cache_memory_bytes:
        kw["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    else:
        kw["num_gpu_blocks_override"] = num_blocks
    t = time.perf_counter()
    llm = LLM(model, **kw)
    load = time.perf_counter() - t
    llm.generate([[11, 12, 13, 14]] * 2, SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    return llm, load


def backend_name(llm) -> str:
    return type(llm.engine.runner.backend).name


def blocks_for(prompts, output_len: int, block_size: int, max_model_len: int) -> int:
    """Enough blocks for every request at once (and for one max_model_len request)."""
    need = sum(-(-(len(p) + output_len) // block_size) for p in prompts)
    return max(need, -(-max_model_len // block_size)) + 2 * len(prompts) + 16


def timed_generate(llm, prompts, output_len: int, ignore_eos: bool) -> dict:
    """One timed run; returns the tokens, the wall time and the engine's step stats of this run."""
    from tokenmill import SamplingParams

    core = llm.engine.core
    if not core.reset_prefix_cache():
        print("warning: prefix cache not reset (blocks in use)", file=sys.stderr)
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=ignore_eos)
    watch = OtherLoad()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    others = watch.cores()
    steps = [s for s in llm.engine.stats.history if s.end_time >= t0]
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens": n, "wall": wall, "tok_s": n / wall, "steps": steps, "env": env(),
            "others": warn_if_busy(others, "during this run")}


def attn_of(s) -> tuple[float, float | None]:
    """(attention seconds, K/V bytes or None) of a step; 0 seconds where the engine does not time it."""
    return float(getattr(s, "attn_s", 0.0) or 0.0), getattr(s, "attn_bytes", None)


def phase_split(run: dict, kv_bytes_per_token: int) -> dict:
    steps, wall = run["steps"], run["wall"]
    pre = [s for s in steps if s.num_tokens > s.num_requests]
    dec = [s for s in steps if s.num_tokens <= s.num_requests]

    def attn_bytes(ss):
        b = [attn_of(s)[1] for s in ss]
        if all(x is not None for x in b):
            return sum(b)
        return sum(s.kv_tokens * kv_bytes_per_token for s in ss)  # older engines: sum of context lengths

    p = {
        "prefill": sum(s.forward_s for s in pre),
        "prefill_attention": sum(attn_of(s)[0] for s in pre),
        "decode_forward": sum(s.forward_s for s in dec),
        "decode_attention": sum(attn_of(s)[0] for s in dec),
        "sampling": sum(s.sample_s for s in steps),
        "schedule": sum(s.schedule_s + s.offload_s for s in steps),
        "prepare": sum(s.prepare_s for s in steps),
        "detokenize": sum(s.detokenize_s for s in steps),
        "decode_attn_bytes": attn_bytes(dec),
        "prefill_steps": len(pre),
        "decode_steps": len(dec),
        "wall": wall,
    }
    p["timed"] = p["prefill_attention"] + p["decode_attention"] > 0
    p["decode_rest"] = p["decode_forward"] - p["decode_attention"]
    p["overhead"] = wall - p["prefill"] - p["decode_forward"] - p["sampling"]
    return p


def print_phases(label: str, p: dict, bw: float, e: dict) -> None:
    w = p["wall"]

    def f(x):
        return f"{x:7.2f} s {100 * x / w:5.1f}%"

    print(f"  {label} where the time went (wall {w:.2f} s, {p['prefill_steps']} steps with prompt tokens, "
          f"{p['decode_steps']} decode-only steps)  {env_str(e)}")
    pa = f"; attention {p['prefill_attention']:.2f} s inside" if p["timed"] else ""
    print(f"    prefill (fwd)     {f(p['prefill'])}{pa}")
    if p["timed"]:
        print(f"    decode GEMM+rest  {f(p['decode_rest'])}")
        rate = p["decode_attn_bytes"] / p["decode_attention"] if p["decode_attention"] else 0.0
        print(f"    decode attention  {f(p['decode_attention'])}  ({rate / 1e9:.2f} GB/s K/V read, "
              f"{100 * rate / bw:.0f}% of {bw / 1e9:.1f} GB/s stream)")
    else:
        print(f"    decode forward    {f(p['decode_forward'])}  (GEMM+rest and attention together: this engine "
              "does not time attention)")
    print(f"    sampling          {f(p['sampling'])}")
    print(f"    overhead          {f(p['overhead'])}  (schedule {p['schedule']:.2f}, prepare {p['prepare']:.2f}, "
          f"detokenize {p['detokenize']:.2f}, rest of the loop "
          f"{p['overhead'] - p['schedule'] - p['prepare'] - p['detokenize']:.2f})")


def batch1_decode(llm, prompt, output_len: int) -> float:
    from tokenmill import SamplingParams

    e = llm.engine
    e.add_request(f"b1-{time.monotonic_ns()}", prompt, SamplingParams(temperature=0.0, max_tokens=output_len,
                                                                     ignore_eos=True))
    e.step()  # prefill + first token
    t = time.perf_counter()
    steps = 0
    while e.has_unfinished_requests():
        e.step()
        steps += 1
    return steps / (time.perf_counter() - t)


# ---- transformers -------------------------------------------------------------------------------
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
def run_hf_padded(m, prompts, output_len: int, batch: int = 16, pad_id: int = 0, ignore_eos: bool = True) -> float:
    eos = m.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    # Warm-up, as tokenmill gets one: transformers' first generate call takes seconds longer.
    m.generate(torch.tensor([prompts[0][:8]]), max_new_tokens=4, do_sample=False, pad_token_id=pad_id)
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
        kw = dict(min_new_tokens=output_len) if ignore_eos else {}
        out = m.generate(ids, attention_mask=mask, max_new_tokens=output_len, do_sample=False, pad_token_id=pad_id,
                         **kw)
        gen = out[:, width:]
        if ignore_eos or not eos:
            n += gen.numel()
        else:  # count up to and including each row's first EOS, not the padding after it
            for row in gen.tolist():
                k = next((j for j, tok in enumerate(row) if tok in eos), len(row) - 1)
                n += k + 1
    return n / (time.perf_counter() - t)


@torch.inference_mode()
def run_hf_continuous(m, prompts, output_len: int, ignore_eos: bool = True) -> float:
    from transformers import GenerationConfig

    kw = dict(min_new_tokens=output_len, eos_token_id=-1) if ignore_eos else {}
    cfg = GenerationConfig(max_new_tokens=output_len, do_sample=False, pad_token_id=0, **kw)
    m.generate_batch(inputs=prompts[:2], generation_config=cfg, max_new_tokens=4)  # warm-up
    t = time.perf_counter()
    res = m.generate_batch(inputs=prompts, generation_config=cfg)
    dt = time.perf_counter() - t
    n = sum(len(r.generated_tokens) for r in res.values())
    return n / dt


# ---- the two modes ------------------------------------------------------------------------------
def kv_bytes_per_token(llm) -> int:
    return llm.engine.core.info.model_cost.kv_bytes_per_token


def main_throughput(args, model: str, backends: list[str | None], bw: float) -> None:
    from tokenmill.model.loader import load_tokenizer

    warm = None
    if not args.skip_load:
        # Cold: a fresh tokenizer cache (GGUF vocabulary converted); warm: the converted tokenizer is reused.
        with tempfile.TemporaryDirectory() as cache:
            cold = measure_load(model, cache)
            warm = measure_load(model, cache)
        print(f"tokenmill load (fresh process, imports included): cold {cold:.1f} s, warm {warm:.1f} s  {env_str()}")
    tok = load_tokenizer(model)
    make = make_random_id_prompts if args.random_ids else make_prompts
    prompts = make(tok, args.num_prompts, args.input_len_min, args.input_len_max, args.seed)
    lens = [len(p) for p in prompts]
    print(f"workload: {len(prompts)} requests, prompts of {min(lens)}-{max(lens)} tokens (mean "
          f"{statistics.mean(lens):.0f}, {'random ids' if args.random_ids else 'words'}), {args.output_len} output "
          f"tokens, greedy, ignore_eos={args.ignore_eos}, dtype {args.dtype}, KV {args.kv_cache_dtype}")
    max_len = max(lens) + args.output_len + 16
    nblocks = blocks_for(prompts, args.output_len, args.block_size, max_len)

    llms = {}
    for b in backends:
        llm, load = build_llm(model, b, max_len, nblocks, args)
        name = backend_name(llm)
        llms[name] = llm
        print(f"tokenmill[{name}]: built in {load:.1f} s, KV cache {llm.engine.kv.num_blocks} "
              f"blocks of {args.block_size} ({llm.engine.runner.kv_dtype})  {env_str()}")
    names = list(llms)
    kvb = kv_bytes_per_token(llms[names[0]])

    runs = {n: [] for n in names}
    for r in range(args.rounds):
        for n in names:
            run = timed_generate(llms[n], prompts, args.output_len, args.ignore_eos)
            runs[n].append(run)
            print(f"round {r + 1}: tokenmill[{n}]: {run['tok_s']:.1f} output tok/s ({run['tokens']} tokens in "
                  f"{run['wall']:.2f} s)  {env_str(run['env'])}")
            print_phases(f"tokenmill[{n}]", phase_split(run, kvb), bw, run["env"])
            if run["others"]:
                print("    " + run["others"])
    tps = {n: statistics.median(x["tok_s"] for x in runs[n]) for n in names}

    if not args.skip_batch1:
        first = llms[names[0]]
        weight_bytes = sum(p.numel() * p.element_size() for p in first.engine.model.parameters())
        roofline = bw / weight_bytes
        print(f"weights {weight_bytes / 1e6:.0f} MB: batch-1 roofline {roofline:.1f} tok/s at {bw / 1e9:.1f} GB/s")
        for n in names:
            b1 = batch1_decode(llms[n], prompts[0], args.output_len)
            print(f"batch-1 decode tokenmill[{n}]: {b1:.1f} tok/s = {100 * b1 / roofline:.0f}% of the bandwidth "
                  f"roofline  {env_str()}")
    llms.clear()
    first = llm = None
    gc.collect()

    hf = {}
    modes = [m for m in args.hf_modes.split(",") if m] if not args.skip_hf else []
    hf_load = None
    if modes:
        m, hf_load = hf_model(model)
        print(f"transformers load: {hf_load:.1f} s  {env_str()}")
        if "padded" in modes:
            watch = OtherLoad()
            hf["padded"] = run_hf_padded(m, prompts, args.output_len, args.hf_batch, ignore_eos=args.ignore_eos)
            print(f"transformers generate (padded batches of {args.hf_batch}): {hf['padded']:.1f} tok/s  {env_str()}")
            if (note := warn_if_busy(watch.cores(), "during this run")):
                print("    " + note)
        if "continuous" in modes:
            try:
                hf["continuous"] = run_hf_continuous(m, prompts, args.output_len, args.ignore_eos)
                print(f"transformers generate_batch (continuous batching): {hf['continuous']:.1f} tok/s  {env_str()}")
            except Exception as e:  # noqa: BLE001 - report, don't hide
                print(f"transformers generate_batch failed: {type(e).__name__}: {e}", file=sys.stderr)
        del m

    print(f"\nsummary ({args.rounds} round(s), median tok/s)  {env_str()}")
    for n in names:
        print(f"  tokenmill[{n}]: {tps[n]:.1f} tok/s")
    base = names[0]
    for n in names[1:]:
        print(f"  ratio tokenmill[{n}] / tokenmill[{base}]: {tps[n] / tps[base]:.2f}x")
    for n in names:
        if "padded" in hf:
            print(f"  ratio tokenmill[{n}] / padded generate: {tps[n] / hf['padded']:.2f}x")
        if "continuous" in hf:
            print(f"  ratio tokenmill[{n}] / continuous batching: {tps[n] / hf['continuous']:.2f}x")
    if hf_load is not None and warm is not None:
        print(f"  load time: transformers {hf_load:.1f} s (in-process, imports done) vs tokenmill warm {warm:.1f} s "
              f"(fresh process): {hf_load / warm:.1f}x")


def main_long_context(args, model: str, backends: list[str | None], bw: float) -> None:
    from tokenmill.model.loader import load_tokenizer

    n = args.num_prompts
    out_len = args.output_len
    max_pos = model_max_len(model)
    plen = min(args.input_len_max, max_pos - out_len)
    if plen < args.input_len_max:
        print(f"prompt length {args.input_len_max} clamped to {plen}: prompt + {out_len} output tokens must fit the "
              f"model's {max_pos} positions")
    tok = load_tokenizer(model)
    prompts = make_random_id_prompts(tok, n, plen, plen, args.seed)
    max_len = plen + out_len
    nblocks = blocks_for(prompts, out_len, args.block_size, max_len)
    print(f"long context: {n} requests x {plen} random-id prompt tokens, {out_len} output tokens, greedy, "
          f"ignore_eos={args.ignore_eos}, dtype {args.dtype}, KV {args.kv_cache_dtype}, {nblocks} KV blocks")

    llms = {}
    for b in backends:
        llm, load = build_llm(model, b, max_len, nblocks, args)
        llms[backend_name(llm)] = llm
        print(f"tokenmill[{backend_name(llm)}]: built in {load:.1f} s ({llm.engine.runner.kv_dtype} KV)  {env_str()}")
    names = list(llms)
    kvb = kv_bytes_per_token(llms[names[0]])
    res = {nm: [] for nm in names}
    for r in range(args.rounds):
        for nm in names:
            run = timed_generate(llms[nm], prompts, out_len, args.ignore_eos)
            steps = run["steps"]
            # Decode steps where every request decodes; a step's wall time is the gap since the previous
            # step's end (the LLM loop's output handling included).
            gaps = [(s, s.end_time - prev.end_time) for prev, s in zip(steps, steps[1:])
                    if s.num_requests == n and s.num_tokens == n]
            pre = [s for s in steps if s.num_tokens > s.num_requests]
            if not gaps:
                print(f"round {r + 1}: tokenmill[{nm}]: no decode step with all {n} requests; nothing to report")
                continue
            # Medians over the steps (one slow step on a shared machine must not move the figures).
            med = statistics.median
            dsteps = [s for s, _ in gaps]
            step_ms = 1e3 * med(g for _, g in gaps)
            attn = [attn_of(s)[0] for s in dsteps]
            timed = any(t > 0 for t in attn)
            ab = [attn_of(s)[1] for s in dsteps]
            if any(x is None for x in ab):  # engines without attn_bytes: estimate from the context lengths
                ab = [s.kv_tokens * kvb for s in dsteps]
            fwd_ms = 1e3 * med(s.forward_s for s in dsteps)
            x = {"step_ms": step_ms, "tok_s": n * 1e3 / step_ms, "timed": timed, "forward_ms": fwd_ms,
                 "attn_ms": 1e3 * med(attn),
                 "attn_share": med(t / s.busy_s for t, s in zip(attn, dsteps) if s.busy_s > 0),
                 "gemm_rest_ms": 1e3 * med(s.forward_s - t for t, s in zip(attn, dsteps)),
                 "attn_gbs": med(b / t for b, t in zip(ab, attn) if t > 0) / 1e9 if timed else None,
                 "kv_mb": med(ab) / 1e6, "prefill_s": sum(s.forward_s for s in pre), "env": run["env"]}
            res[nm].append(x)
            print(f"round {r + 1}: tokenmill[{nm}]: decode {step_ms:.1f} ms/step = per-token time of each request "
                  f"({x['tok_s']:.1f} output tok/s; medians over {len(gaps)} steps with all {n} decoding); prefill "
                  f"forward {x['prefill_s']:.1f} s  {env_str(run['env'])}")
            if timed:
                print(f"    attention {x['attn_ms']:.1f} ms/step = {100 * x['attn_share']:.0f}% of the step's busy "
                      f"time ({x['kv_mb']:.1f} MB K/V read, {x['attn_gbs']:.2f} GB/s, "
                      f"{100 * x['attn_gbs'] * 1e9 / bw:.0f}% of {bw / 1e9:.1f} GB/s stream); GEMM+rest "
                      f"{x['gemm_rest_ms']:.1f} ms/step")
            else:
                print(f"    attention not timed by this engine; forward {fwd_ms:.1f} ms/step, K/V read "
                      f"{x['kv_mb']:.1f} MB/step")
            if run["others"]:
                print("    " + run["others"])
    print(f"\nsummary ({args.rounds} round(s), medians)  {env_str()}")
    med = {}
    for nm in names:
        if not res[nm]:
            continue
        med[nm] = {k: statistics.median(x[k] for x in res[nm]) for k in ("step_ms", "attn_ms", "attn_share")}
        print(f"  tokenmill[{nm}]: decode {med[nm]['step_ms']:.1f} ms/token/request, attention "
              + (f"{med[nm]['attn_ms']:.1f} ms/step ({100 * med[nm]['attn_share']:.0f}% share)"
                 if res[nm][0]["timed"] else "not timed"))
    base = names[0]
    for nm in names[1:]:
        if nm in med and base in med:
            print(f"  ratio decode step tokenmill[{base}] / tokenmill[{nm}]: "
                  f"{med[base]['step_ms'] / med[nm]['step_ms']:.2f}x (above 1: {nm} faster)")
            if med[nm]["attn_ms"] and med[base]["attn_ms"]:
                print(f"  ratio attention tokenmill[{base}] / tokenmill[{nm}]: "
                      f"{med[base]['attn_ms'] / med[nm]['attn_ms']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--attention-backend", action="append", default=None, metavar="NAME[,NAME]",
                    help="tokenmill attention backend(s); repeatable or a comma list (default: the device's)")
    ap.add_argument("--long-context", action="store_true",
                    help="long-context decode mode: 4 x 8k-token prompts, 128 output tokens (see above)")
    ap.add_argument("--num-prompts", type=int, default=None, help="default 64 (long context: 4)")
    ap.add_argument("--input-len-min", type=int, default=32)
    ap.add_argument("--input-len-max", type=int, default=None, help="default 128 (long context: 8192, clamped)")
    ap.add_argument("--output-len", type=int, default=None, help="default 64 (long context: 128)")
    ap.add_argument("--random-ids", action="store_true", help="prompts of random token ids instead of words")
    ap.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                    help="generate exactly --output-len tokens (default: on; transformers gets min_new_tokens)")
    ap.add_argument("--dtype", default="float32", help="tokenmill weight/compute dtype (default: float32)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                    help="default: sized so every request fits at once")
    ap.add_argument("--rounds", type=int, default=1, help="timed runs per backend, interleaved (median reported)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bw-gib", type=float, default=1.0, help="size of the bandwidth probe tensor")
    ap.add_argument("--skip-hf", action="store_true", help="tokenmill only")
    ap.add_argument("--hf-modes", default="padded,continuous", help="comma list of padded, continuous")
    ap.add_argument("--hf-batch", type=int, default=16, help="batch size of transformers padded generate")
    ap.add_argument("--skip-load", action="store_true", help="skip the fresh-process load-time measurement")
    ap.add_argument("--skip-batch1", action="store_true", help="skip the batch-1 decode measurement")
    ap.add_argument("--tune-malloc", action="store_true",
                    help="fix glibc's malloc thresholds as tokenmill's own processes (serve, engine core) do; the "
                    "LLM library leaves them alone, so by default this script does too")
    args = ap.parse_args()
    long = args.long_context
    if args.num_prompts is None:
        args.num_prompts = 4 if long else 64
    if args.input_len_max is None:
        args.input_len_max = 8192 if long else 128
    if args.output_len is None:
        args.output_len = 128 if long else 64
    if args.threads:
        torch.set_num_threads(args.threads)
    tuned = False
    if args.tune_malloc:
        from tokenmill.platform import tune_malloc

        tuned = tune_malloc()

    backends: list[str | None] = []
    for item in args.attention_backend or []:
        backends += [x.strip() for x in item.split(",") if x.strip()]
    backends = list(dict.fromkeys(backends)) or [None]  # None: the device's default
    import tokenmill.layers.attention_backends as ab

    avail = ab.available_backends("cpu")
    missing = [b for b in backends if b is not None and b not in avail]
    if missing:
        raise SystemExit(f"attention backend(s) {', '.join(missing)} not available; available: {', '.join(avail)}")

    from tokenmill.model.default import resolve_model

    model = resolve_model(args.model)
    e0 = env()
    bw = measure_bandwidth(int(args.bw_gib * (1 << 30)))
    print(f"model: {model}\ntorch {torch.__version__}, threads {torch.get_num_threads()}, load {e0['loadavg']}, "
          f"malloc thresholds {'fixed (--tune-malloc)' if tuned else 'glibc adaptive'}")
    print(f"memory bandwidth (streaming read, best of 5 sums over {args.bw_gib:g} GiB): {bw / 1e9:.1f} GB/s  "
          f"{env_str()}")
    if long:
        main_long_context(args, model, backends, bw)
    else:
        main_throughput(args, model, backends, bw)


if __name__ == "__main__":
    main()
