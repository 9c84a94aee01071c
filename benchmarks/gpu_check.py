"""The prepared device check (issue 31): everything tokenmill wants to know from a GPU, in one run of a few minutes.

    bash benchmarks/gpu_check.sh [OUT]              # on the GPU machine (installs the carried wheels first)
    python benchmarks/gpu_check.py --device cpu --quick --out /tmp/x   # here: the script's own smoke test

Sections (each timed and reported on its own; one failing does not stop the rest):
1. env: torch, CUDA, the GPU, Triton, the attention backend tokenmill picks.
2. attention: every attention backend the device supports against dense float64 attention on random paged
   batches (prompt chunks over cached prefixes, decodes, GQA/MQA, a sliding window, bfloat16 and float32).
3. parity: a tiny random Llama through the engine on the device (each backend; triton_paged with CUDA graphs
   and with --enforce-eager) and a tiny Mixtral (float MoE) against transformers on the CPU
   in float32: greedy tokens equal, the largest logprob difference.
4. throughput: the embedded SmolLM2 (and --model M if given): decode tok/s at batch 1 (with CUDA graphs and
   with --enforce-eager) and offline tok/s at 64 concurrent requests.
5. serve: `tokenmill serve` on the model, 32 concurrent streamed chat requests: TTFT and tok/s.
6. roofline: a bf16 GEMM's TFLOP/s and a device copy's bandwidth against the card's published peaks.
Writes OUT/report.json and OUT/report.md (the figures docs/performance.md wants).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _servers  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "layers")]

# Published dense peaks (bf16 tensor-core TFLOP/s without sparsity, HBM TB/s) by device-name fragment.
PEAKS = {"H200": (989.0, 4.8), "H100": (989.0, 3.35), "A100": (312.0, 2.0), "L40S": (362.0, 0.864),
         "A10": (125.0, 0.6), "L4": (121.0, 0.3)}


def env(args) -> dict:
    import torch

    from tokenmill.layers.attention_backends import available_backends, default_backend

    out = {"torch": torch.__version__, "python": sys.version.split()[0], "device": args.device,
           "backends": available_backends(args.device), "default_backend": default_backend(args.device)}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    if args.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                   cuda=torch.version.cuda)
    return out


def attention(args) -> dict:
    """Random paged batches on the device vs float64 dense attention (tests/layers/test_attention_backends.py's
    reference), per backend and case: the largest error."""
    import torch

    from test_attention_backends import dense_reference
    from tokenmill.layers.attention import Attention
    from tokenmill.layers.attention_backends import BatchLayout, available_backends, get_attention_backend, kv_quant

    dev = torch.device(args.device)
    names = [n for n in available_backends(dev) if args.device == "cuda" or n != "triton_paged"]
    results = {}
    g = torch.Generator().manual_seed(0)
    for name in names:
        for dtype in (torch.bfloat16, torch.float32):
            for H, Hk, window in ((8, 8, None), (8, 2, None), (8, 1, 24)):
                D, bs = 128, 16
                backend = get_attention_backend(name, dev)(bs, dev)
                layer = Attention(H, Hk, D, D**-0.5, window)
                backend.allocate_kv_cache([layer], 64, dtype)
                # A pool of NaN, as a reused allocation may hold: each backend keeps its own contract against it
                # (torch_sdpa zeroes a block on first use, the paged kernels never read past kv_len). Marking the
                # blocks initialised instead let an H200's leftover bytes through torch_sdpa's mask (3.7e19 off).
                for t in kv_quant.layer_caches(layer):
                    t.view(torch.uint8).fill_(0xFF)  # all-ones bytes: NaN in every float format
                # three requests: a prompt of 70 over nothing, a chunk of 20 over 40 cached, a decode over 150
                reqs = [(0, 70), (40, 20), (150, 1)]
                perm = torch.randperm(64, generator=g).tolist()
                tables, full = [], []
                for start, n in reqs:
                    nb = -(-(start + n) // bs)
                    tables.append([perm.pop() for _ in range(nb)])
                    full.append([torch.randn(start + n, h, D, generator=g, dtype=torch.float64).to(dtype).double()
                                 for h in (H, Hk, Hk)])
                # the cached prefixes first (as earlier steps wrote them), then the step
                for phase in ("prefix", "step"):
                    q_len = [s if phase == "prefix" else n for s, n in reqs]
                    first = [0 if phase == "prefix" else s for s, _ in reqs]
                    keep = [i for i, n in enumerate(q_len) if n]
                    width = max(len(t) for t in tables)
                    table = torch.zeros(len(keep), width, dtype=torch.int32)
                    slots, qs, ks, vs = [], [], [], []
                    for j, i in enumerate(keep):
                        table[j, : len(tables[i])] = torch.tensor(tables[i])
                        pos = torch.arange(first[i], first[i] + q_len[i])
                        slots.append(torch.tensor(tables[i])[pos // bs] * bs + pos % bs)
                        q, k, v = (x[first[i] : first[i] + q_len[i]] for x in full[i])
                        qs.append(q), ks.append(k), vs.append(v)
                    ql = torch.tensor([q_len[i] for i in keep])
                    layout = BatchLayout(query_start=torch.cumsum(ql, 0) - ql, query_len=ql,
                                         kv_len=torch.tensor([first[i] + q_len[i] for i in keep]), block_table=table,
                                         slot_mapping=torch.cat(slots), num_tokens=int(ql.sum()),
                                         max_query_len=int(ql.max()), max_kv_len=max(first[i] + q_len[i] for i in keep))
                    out = layer(*(torch.cat(x).to(dev, dtype) for x in (qs, ks, vs)), backend.build_metadata(layout))
                if args.device == "cuda":
                    torch.cuda.synchronize()
                err, row = 0.0, 0
                for (start, n), (q, k, v) in zip(reqs, full):
                    want = dense_reference(q[start:], k, v, layer.scale, window)
                    diff = (out[row : row + n].double().cpu() - want).abs().max()
                    err = max(err, float(diff) if diff.isfinite() else float("inf"))  # (max() drops a NaN)
                    row += n
                tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
                results[f"{name} {str(dtype)[6:]} H{H}/Hk{Hk}{' window' if window else ''}"] = {
                    "max_error": err, "ok": err < tol}
    return results


def parity(args) -> dict:
    """A tiny random Llama on the device through the engine vs transformers on the CPU (float32)."""
    import tempfile

    import torch

    from test_parity import hf_greedy, prompts_for
    from tiny import make_tiny_model
    from tokenmill import LLM, SamplingParams
    from tokenmill.layers.attention_backends import available_backends

    out = {}
    runs = [(n, {}) for n in available_backends(args.device) if args.device == "cuda" or n != "triton_paged"]
    if args.device == "cuda":  # the CUDA default replays decode batches from CUDA graphs: eager beside it
        runs.append(("triton_paged", {"enforce_eager": True}))
    for arch in ("llama", "mixtral"):  # (mixtral: float MoE, through the Triton grouped GEMM on CUDA)
        path = make_tiny_model(Path(tempfile.mkdtemp()) / arch, arch)
        oracle = None
        for name, kw in runs if arch == "llama" else runs[:1]:
            llm = LLM(str(path), device=args.device, attention_backend=name, max_model_len=128,
                      num_gpu_blocks_override=64, block_size=16, max_num_seqs=8, **kw)
            graphs = llm.engine.core.executor.worker.runner.graphs
            prompts = prompts_for(llm.engine.vocab_size)[: (2 if args.quick else 8)]
            if oracle is None:
                oracle = hf_greedy(path, prompts)
            got = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1),
                               use_tqdm=False)
            same = all(g.outputs[0].token_ids == t for g, (t, _) in zip(got, oracle))
            diff = max(abs(lp.logprob - float(ref[step, tid]))
                       for g, (_, ref) in zip(got, oracle) for step, entry in enumerate(g.outputs[0].logprobs)
                       for tid, lp in entry.items())
            label = f"{arch}/{name}" + ("/eager" if kw else "/graphs" if graphs is not None else "")
            out[label] = {"same_tokens": same, "max_logprob_diff": diff,
                          "graph_replays": graphs.stats.replays if graphs is not None else 0}
            del llm
            if args.device == "cuda":
                torch.cuda.empty_cache()
    return out


# SmolLM2-135M-Instruct's shapes (the embedded model's), for a random-weight stand-in where its package is missing;
# its vocabulary of 49152 is the test tokenizer's 384 tokens and added ones.
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=True)
SMOLLM2_VOCAB = 49152


def _models(args) -> list[str | None]:
    """The embedded model (None), else a random model of its shapes; and --model if given."""
    from tokenmill.model.default import default_model_path

    try:
        default_model_path()
        models: list[str | None] = [None]
    except FileNotFoundError:
        import tempfile

        import torch

        from tiny import build_tokenizer, make_tiny_model

        extra = tuple(f"<x{i}>" for i in range(SMOLLM2_VOCAB - len(build_tokenizer())))
        shapes = dict(SMOLLM2, num_hidden_layers=2) if args.quick else SMOLLM2
        models = [str(make_tiny_model(Path(tempfile.mkdtemp()) / "smollm2-shapes", "llama", added_tokens=extra,
                                      dtype=torch.bfloat16 if args.device == "cuda" else torch.float32, **shapes))]
    return models + ([args.model] if args.model else [])


def _batch1_decode(llm, prompt, n: int) -> float:
    """Decode tok/s of one request after its prefill step."""
    from tokenmill import SamplingParams

    e = llm.engine
    e.add_request("b1", None, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), prompt_token_ids=prompt)
    e.step()
    t0 = time.perf_counter()
    while e.has_unfinished_requests():
        e.step()
    return (n - 1) / (time.perf_counter() - t0)


def throughput(args) -> dict:
    from tokenmill import LLM, SamplingParams

    out = {}
    for model in _models(args):
        llm = LLM(model, device=args.device, max_num_seqs=64)
        tok = llm.get_tokenizer()
        prompt = tok.apply_chat_template([{"role": "user", "content": "Write a long story about a lighthouse."}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
        n1 = 32 if args.quick else 256
        b1 = _batch1_decode(llm, prompt, n1)
        n64 = 4 if args.quick else 64
        params = SamplingParams(temperature=0, max_tokens=16 if args.quick else 256, ignore_eos=True)
        t0 = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": prompt}] * n64, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        graphs = llm.engine.core.executor.worker.runner.graphs is not None
        row = {"cuda_graphs": graphs, "batch1_decode_tok_s": round(b1, 1),
               f"batch{n64}_tok_s": round(sum(len(r.outputs[0].token_ids) for r in res) / dt, 1)}
        out[model or "embedded SmolLM2-135M"] = row
        llm.close()  # its KV pool took gpu_memory_utilization of the card: the next engine needs it back
        if graphs:  # the same batch-1 decode without graphs: what they save
            with LLM(model, device=args.device, max_num_seqs=64, enforce_eager=True) as eager:
                row["batch1_decode_tok_s_eager"] = round(_batch1_decode(eager, prompt, n1), 1)
            row["graphs_vs_eager"] = round(b1 / row["batch1_decode_tok_s_eager"], 2)
    return out


def serve(args) -> dict:
    """tokenmill serve on the first model, 32 concurrent streamed chat completions."""
    import asyncio

    import httpx

    models = _models(args)
    if not models:
        return {"skipped": "no model"}
    port = _servers.next_port()
    cmd = [sys.executable, "-m", "tokenmill", "serve", "--port", str(port), "--device", args.device]
    if models[0]:
        cmd += ["--model", models[0]]
    log = open(Path(args.out) / "serve.log", "w+b") if args.out else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

    def tail() -> str:
        if log is subprocess.DEVNULL:
            return ""
        log.flush()
        log.seek(0)
        return log.read().decode(errors="replace")[-1500:]

    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if proc.poll() is not None:  # it died starting: say why at once instead of waiting out the deadline
                return {"error": f"the server exited with {proc.returncode} while starting", "log_tail": tail()}
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            return {"error": "the server did not come up within 180 s", "log_tail": tail()}
        model_id = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]

        async def one(client, i):
            t0 = time.perf_counter()
            ttft, n = None, 0
            body = {"model": model_id, "stream": True, "max_tokens": 16 if args.quick else 128,
                    "messages": [{"role": "user", "content": f"Tell me fact number {i} about the sea."}]}
            async with client.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        ttft = ttft or time.perf_counter() - t0
                        n += 1
            return ttft, n

        async def all_of(k):
            async with httpx.AsyncClient() as client:
                return await asyncio.gather(*(one(client, i) for i in range(k)))

        k = 4 if args.quick else 32
        t0 = time.perf_counter()
        res = asyncio.run(all_of(k))
        dt = time.perf_counter() - t0
        ttfts = sorted(t for t, _ in res if t is not None)
        return {"requests": k, "tok_s": round(sum(n for _, n in res) / dt, 1),
                "ttft_p50_s": round(ttfts[len(ttfts) // 2], 3) if ttfts else None,
                "ttft_max_s": round(ttfts[-1], 3) if ttfts else None}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def roofline(args) -> dict:
    import torch

    dev = torch.device(args.device)
    n = 1024 if args.quick or args.device != "cuda" else 8192
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    x = torch.empty(2**28 if args.device == "cuda" else 2**24, device=dev, dtype=torch.uint8)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def timed(fn, reps):
        for _ in range(3):
            fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        return (time.perf_counter() - t0) / reps

    gemm_s = timed(lambda: a @ b, 10)
    copy_s = timed(lambda: x.clone(), 10)
    out = {"gemm_n": n, "gemm_dtype": str(dtype)[6:], "gemm_tflops": round(2 * n**3 / gemm_s / 1e12, 1),
           "copy_tb_s": round(2 * x.numel() / copy_s / 1e12, 3)}
    if args.device == "cuda":
        name = torch.cuda.get_device_properties(0).name
        peak = next((v for k, v in PEAKS.items() if k in name), None)
        if peak:
            out.update(peak_tflops=peak[0], peak_tb_s=peak[1], gemm_share=round(out["gemm_tflops"] / peak[0], 2),
                       copy_share=round(out["copy_tb_s"] / peak[1], 2))
    return out


def step_profile(args) -> dict:
    """Where an eager batch-1 decode step's time goes (graphs off, as every prompt step runs): the engine's
    Python functions by own time (cProfile) and the torch ops by host time (torch.profiler), over 32 steps."""
    import cProfile
    import io
    import pstats

    import torch

    from tokenmill import LLM, SamplingParams

    model = _models(args)[0]
    n = 8 if args.quick else 32
    with LLM(model, device=args.device, max_num_seqs=8, max_model_len=2048, enforce_eager=True) as llm:
        e = llm.engine
        e.add_request("p", None, SamplingParams(temperature=0, max_tokens=2 * n + 8, ignore_eos=True),
                      prompt_token_ids=list(range(100, 228)))
        for _ in range(n):  # prefill and warm-up
            e.step()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(n // 2):
            e.step()
        prof.disable()
        python_s = (time.perf_counter() - t0) / (n // 2)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
        activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if args.device == "cuda" else [])
        with torch.profiler.profile(activities=activities) as tp:
            for _ in range(n // 2):
                e.step()
        ops = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
    if args.out:
        (Path(args.out) / "step_profile.txt").write_text(text.getvalue() + "\n\n" + ops)
    lines = [ln for ln in text.getvalue().splitlines() if ln.strip()][:40]
    return {"step_ms_under_cprofile": round(python_s * 1e3, 2), "cprofile_top": lines[-26:]}


SECTIONS = {"env": env, "attention": attention, "parity": parity, "throughput": throughput, "serve": serve,
            "roofline": roofline, "step_profile": step_profile}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=None, help="a larger HF model folder to measure too, if present")
    ap.add_argument("--quick", action="store_true", help="small sizes (the CPU smoke test)")
    ap.add_argument("--only", default=None, help="comma-separated sections")
    _servers.add_port_argument(ap)
    args = ap.parse_args()
    _servers.install(args.port)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {}
    for name, fn in SECTIONS.items():
        if args.only and name not in args.only.split(","):
            continue
        t0 = time.perf_counter()
        try:
            report[name] = {"result": fn(args)}
        except Exception as e:  # one section's failure is a finding, not the end of the check
            report[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
        report[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"[{name}] {json.dumps(report[name].get('result', report[name].get('error')))[:600]}", flush=True)
        (out_dir / "report.json").write_text(json.dumps(report, indent=1, default=str))
    lines = ["# gpu_check report", ""]
    for name, r in report.items():
        lines.append(f"## {name} ({r['seconds']} s)")
        lines.append("```")
        lines.append(json.dumps(r.get("result", r.get("error")), indent=1, default=str))
        lines.append("```")
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")
    return 1 if any("error" in r for r in report.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
