"""Long context with KV cache groups: how many Gemma 3 requests at 8k context one fixed KV pool holds at once.

A random-weight Gemma 3 with the real model's attention pattern (five sliding-window layers of window 512 per
full-attention layer; one KV head) runs the same workload twice in one process, on the same KV bytes: with
KV cache groups (the default: the windowed layers release what slid out of their window) and with
--disable-hybrid-kv-cache-manager (every layer keeps the whole context). The workload: --requests prompts of
--context - --decode tokens, all submitted at once, each decoding --decode tokens; the pool holds --fit whole
contexts of every layer. Printed per run: the most requests running at once, their mean over the decode steps,
preemptions, wall time and output tok/s (a request lives for its prompt's chunks and --decode
steps, so with long decodes requests pile up until the pool, not the token budget, bounds them); then the ratio of concurrent requests (issue 29's goal: >= 3x) and
what blocks_for_tokens predicts from the layer pattern alone.

    python benchmarks/long_context.py                         # 6 layers, 8k context, 32 requests, pool of 4
    python benchmarks/long_context.py --layers 12 --context 16384 --requests 24
    python benchmarks/long_context.py --part weights         # only the weights part (embedded SmolLM2)
    python benchmarks/long_context.py --part cp              # only context parallelism: a 16k prompt on 1 and 2 ranks

The weights part first: batch-1 decode of the embedded SmolLM2 with every weight resident and with a third
resident (--weights-resident-gb), the rest streamed from disk each step; tok/s of both, and the bound the
disk's read speed, measured on the stream file, sets.

The model is tiny (hidden --hidden) so the run is about the KV cache, not the matmuls: what it shows is how
many requests share the pool, which is what bounds a long-context server's batch.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from measure import OtherLoad, env_str  # noqa: E402


def build(root: Path, args) -> Path:
    from tiny import make_tiny_model

    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(args.layers)]
    return make_tiny_model(root / "gemma3", "gemma3", hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                           num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=1,
                           head_dim=args.head_dim, query_pre_attn_scalar=args.head_dim, sliding_window=args.window,
                           layer_types=types, max_position_embeddings=args.context + 64)


def run(path: Path, args, kv_bytes: int, hybrid: bool) -> dict:
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(path), max_model_len=args.context, block_size=16, kv_cache_memory_bytes=kv_bytes,
              max_num_batched_tokens=args.chunk, max_num_seqs=args.requests,
              disable_hybrid_kv_cache_manager=not hybrid)
    engine = llm.engine
    prompt_len = args.context - args.decode
    sp = SamplingParams(temperature=0.0, max_tokens=args.decode, min_tokens=args.decode, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request(str(i), None, sp, prompt_token_ids=[3 + (i * 31 + j * 7) % 250 for j in range(prompt_len)])
    most, running_per_step = 0, []
    other = OtherLoad()
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.running
        most = max(most, len(running))
        running_per_step.append(len(running))
    wall = time.perf_counter() - t0
    tokens = args.requests * args.decode
    info = engine.core.info
    return dict(hybrid=hybrid, groups=info.kv_group_windows, blocks=info.num_blocks, block_bytes=info.bytes_per_block,
                most=most, mean_running=sum(running_per_step) / len(running_per_step) if running_per_step else 0.0,
                preemptions=engine.scheduler.num_preemptions, wall=wall, tok_s=tokens / wall,
                other=other.cores())


def weights_part(args) -> None:
    """Batch-1 decode of the embedded SmolLM2 (GGUF) fully resident and with a third of its weights resident,
    the rest streamed from disk every step (--weights-resident-gb): tok/s of each, and the bound the disk's
    measured read speed sets on the streamed run (one step reads every streamed layer once)."""
    from tokenmill import LLM, SamplingParams
    from tokenmill import diagnostics as d

    prompt = [[5 + (j * 7) % 300 for j in range(64)]]
    sp = SamplingParams(temperature=0.0, max_tokens=args.weights_tokens, min_tokens=args.weights_tokens,
                        ignore_eos=True)
    results = {}
    total = None
    for name in ("resident", "streamed"):
        kw = dict(max_model_len=512, kv_cache_memory_bytes=64 << 20)
        if name == "streamed":
            kw["weights_resident_gb"] = total / 3 / 2**30
        llm = LLM(args.weights_model, **kw)
        if total is None:
            total = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
        llm.generate(prompt, SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        out = llm.generate(prompt, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        steps = [s for s in llm.engine.stats.history if s.end_time >= t0 and s.num_tokens == 1]
        report = d.engine_diagnostics(llm.engine, last_n=len(steps))
        results[name] = dict(tok_s=len(out[0].outputs[0].token_ids) / wall, tokens=out[0].outputs[0].token_ids,
                             weights=report.get("weights"),
                             step_s=sum(s.forward_s + s.sample_s + s.prepare_s for s in steps) / len(steps))
        del llm
    r, s = results["resident"], results["streamed"]
    w = s["weights"]
    disk_s = w["read_s_per_step"]
    print(f"weights: {total / 2**20:.1f} MiB; resident {r['tok_s']:.1f} tok/s; a third resident "
          f"({w['resident_bytes'] / 2**20:.1f} MiB, {len(w['streamed_layers'])} layers streamed, "
          f"{w['streamed_bytes_per_step'] / 2**20:.1f} MiB per step) {s['tok_s']:.1f} tok/s = "
          f"{s['tok_s'] / r['tok_s']:.2f}x; same tokens: {r['tokens'] == s['tokens']}")
    print(f"  disk read {w['read_bytes_per_s'] / 2**20:.0f} MiB/s -> {1e3 * disk_s:.1f} ms of reads per step "
          f"(at most {1 / disk_s:.1f} tok/s); compute {1e3 * w['compute_s_per_step']:.1f} ms, waited "
          f"{1e3 * w['wait_s_per_step']:.1f} ms per step; bound: {w['bound']}; measured step "
          f"{1e3 * s['step_s']:.1f} ms {env_str()}")


def cp_part(args) -> None:
    """Prefill of one --cp-prompt-token prompt (time to its first token) on one rank, on two decode-context-parallel
    ranks (K/V split, matmuls replicated) and on two prefill-context-parallel ranks (tokens split too), on a tiny
    Llama (hidden --cp-hidden: at 64 attention dominates at that length, at 256 the matmuls weigh more), with the
    step's attention and collective times from the engine's own figures; the fitted model is in docs/scaling.md."""
    from tokenmill import LLM, SamplingParams

    from tiny import make_tiny_model

    n = args.cp_prompt
    with tempfile.TemporaryDirectory() as tmp:
        h = args.cp_hidden
        path = make_tiny_model(Path(tmp) / "llama", "llama", hidden_size=h, intermediate_size=2 * h,
                               num_hidden_layers=2, max_position_embeddings=n + 64)
        prompt = [[3 + (j * 7) % 300 for j in range(n)]]
        rows = []
        for label, kw in (("1 rank, torch_sdpa", dict(attention_backend="torch_sdpa")),
                          ("1 rank, cpu_paged", dict(attention_backend="cpu_paged")),
                          ("2 ranks (dcp)", dict(decode_context_parallel_size=2)),
                          ("2 ranks (pcp)", dict(prefill_context_parallel_size=2))):
            llm = LLM(str(path), max_model_len=n + 16, block_size=16, max_num_batched_tokens=args.chunk,
                      kv_cache_memory_bytes=2 * 2 * h * 4 * (n + 64) * 2, enable_prefix_caching=False, **kw)
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
            t0 = time.perf_counter()
            llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
            wall = time.perf_counter() - t0
            steps = [s for s in llm.engine.stats.history if s.end_time >= t0]
            rows.append((label, wall, sum(s.attn_s for s in steps), sum(s.collective_s for s in steps), len(steps)))
            del llm
    base = rows[0][1]
    print(f"prefill of a {n}-token prompt in chunks of {args.chunk} (tiny Llama, 2 layers, hidden {h}) {env_str()}")
    for label, wall, attn, coll, steps in rows:
        print(f"  {label:20s} {wall:7.2f} s ({base / wall:.2f}x of 1 rank torch_sdpa); attention {attn:.2f} s, "
              f"collectives {coll:.2f} s over {steps} steps")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--decode", type=int, default=512, help="tokens each request decodes (long: requests pile up)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--fit", type=int, default=4, help="whole contexts (every layer) the KV pool holds")
    ap.add_argument("--chunk", type=int, default=1024, help="max_num_batched_tokens (prompt chunk)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--part", choices=("kv", "weights", "cp", "all"), default="all")
    ap.add_argument("--cp-prompt", type=int, default=16384, help="prompt tokens of the context-parallel part")
    ap.add_argument("--cp-hidden", type=int, default=64, help="hidden size of the context-parallel part's model")
    ap.add_argument("--weights-model", default=None, help="model for the weights part (default: embedded SmolLM2)")
    ap.add_argument("--weights-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.part in ("weights", "all"):
        weights_part(args)
    if args.part in ("cp", "all"):
        cp_part(args)
    if args.part in ("weights", "cp"):
        return

    from tokenmill.core.kv_cache import blocks_for_tokens

    per_layer_token = 2 * 1 * args.head_dim * 4  # K and V, one KV head, float32
    kv_bytes = args.fit * args.layers * args.context * per_layer_token
    print(f"Gemma 3 pattern, {args.layers} layers (window {args.window}), {args.context}-token contexts, "
          f"{args.requests} requests, KV pool {kv_bytes / 2**20:.0f} MiB = {args.fit} whole contexts {env_str()}")
    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp), args)
        results = [run(path, args, kv_bytes, hybrid) for hybrid in (False, True)]
    for r in results:
        name = "groups" if r["hybrid"] else "whole "
        other = f", other load {r['other']:.2f} cores" if r["other"] is not None else ""
        print(f"{name}: {len(r['groups'])} block table(s), {r['blocks']} blocks of {r['block_bytes']} B; "
              f"running at once: most {r['most']}, mean over the steps {r['mean_running']:.1f}; preemptions "
              f"{r['preemptions']}; {r['wall']:.1f} s, {r['tok_s']:.1f} output tok/s{other}")
    whole, grouped = results
    windows = grouped["groups"]
    peak = blocks_for_tokens(args.context, windows, 16, args.chunk)
    decode = blocks_for_tokens(args.context, windows, 16, 1)
    full_need = -(-args.context // 16)
    print(f"predicted per request: whole {full_need} blocks of {args.layers} layers = {full_need * args.layers} "
          f"layer-blocks; groups {peak} layer-blocks while its prompt is computed in chunks of {args.chunk}, "
          f"{decode} while decoding -> {full_need * args.layers / peak:.2f}x / {full_need * args.layers / decode:.2f}x "
          f"requests in the same pool")
    print(f"measured: most running at once {grouped['most']} vs {whole['most']} = "
          f"{grouped['most'] / max(whole['most'], 1):.2f}x; mean over the steps {grouped['mean_running']:.1f} vs "
          f"{whole['mean_running']:.1f} = {grouped['mean_running'] / max(whole['mean_running'], 1e-9):.2f}x; "
          f"output tok/s {grouped['tok_s'] / whole['tok_s']:.2f}x {env_str()}")


if __name__ == "__main__":
    main()
