"""One attention layer call through the backend interface (tokenmill.layers.attention_backends), every
backend side by side in one process on the same K/V, queries and shuffled block tables.

    python benchmarks/attention.py                               # all CPU backends, all four cases
    python benchmarks/attention.py --backends torch_sdpa,cpu_paged --repeats 50
    python benchmarks/attention.py --cases decode_f32,long_decode --threads 2
    python benchmarks/attention.py --decode-requests 4 --long-ctx 512 --repeats 3 --bw-gib 0.25   # smoke test

Cases (SmolLM2-135M geometry by default: 9 query heads, 3 KV heads, head_dim 64, block_size 16; every
request's blocks drawn in random order from a pool --pool-factor times larger than needed):
  decode_f32    decode of 64 requests, context lengths uniform in 200-400, float32 cache
  decode_bf16   the same requests with a bfloat16 cache (q/k/v stay float32, as the engine passes them)
  long_decode   decode of 4 requests x 8,192 tokens of context, float32 cache
  prefill       one prompt chunk of 512 tokens over a 1,024-token cached prefix, float32 cache

Per case and backend it prints: build_metadata ms (once per step, shared by all layers) and forward ms
(one layer's call: the K/V write of this step's tokens plus attention; median of --repeats after
--warmup, min-max too), the valid K/V bytes the call must read (sum of context lengths x kv_heads x
head_dim x 2 x itemsize), the achieved GB/s and its share of this machine's streaming read bandwidth
(best of several sums over a --bw-gib float32 tensor, measured at start), the max abs difference of the
output from the baseline backend (--baseline, torch_sdpa) and from a float64 dense reference, and the
time ratio baseline / backend (above 1: faster than the baseline). Every figure line carries
os.getloadavg() and torch's thread count: the machine may be shared.

Backend calls are interleaved repeat by repeat, so drift on a shared machine hits all backends alike.
Before every timed call a --flush-mb buffer is read, so the layer's K/V comes from memory as in the
engine, where the other layers' weights and caches pass through the caches between two calls of one
layer (--flush-mb 0: warm caches). glibc's malloc thresholds are fixed as in tokenmill's own processes
(tokenmill.platform.tune_malloc; --no-tune-malloc leaves them adaptive). --json PATH also writes every
figure.

On a shared machine: when another process keeps a core busy, every OpenMP parallel region waits for
its descheduled thread, and the times come out as multiples of the scheduler tick (seen here: 8.0, 16.0,
24.0, 40.0 ms). Each case prints how many cores other processes used during its timed calls (from /proc/stat)
and warns when they competed with the threads; --threads 1 sidesteps it.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass, field

import torch

from measure import OtherLoad, env, env_str, measure_bandwidth, warn_if_busy

CPU = torch.device("cpu")
ALL_CASES = ("decode_f32", "decode_bf16", "long_decode", "prefill")


@dataclass
class Case:
    name: str
    what: str
    q_len: list[int]  # new tokens per request
    kv_len: list[int]  # context after this step (cached prefix + new)
    dtype: torch.dtype  # cache dtype


@dataclass
class Data:
    """Everything the backends share for one case: logical K/V of every request, this step's q/k/v,
    the shuffled block tables and the layout."""

    case: Case
    H: int
    Hk: int
    D: int
    bs: int
    pool: int
    tables: list[torch.Tensor]  # per request, its block ids
    k_all: list[torch.Tensor]  # per request [kv_len, Hk, D] float32, already rounded to the cache dtype
    v_all: list[torch.Tensor]
    q: torch.Tensor  # [T, H, D] float32
    k: torch.Tensor  # [T, Hk, D] this step's new tokens (the tails of k_all)
    v: torch.Tensor
    layout: object = None
    outs: dict = field(default_factory=dict)


def make_cases(a) -> dict[str, Case]:
    g = torch.Generator().manual_seed(a.seed)
    lo, hi = a.decode_ctx
    ctx = torch.randint(lo, hi + 1, (a.decode_requests,), generator=g).tolist()
    dec = f"decode, {a.decode_requests} requests, context {lo}-{hi} (mean {statistics.mean(ctx):.0f})"
    return {
        "decode_f32": Case("decode_f32", dec + ", float32 cache", [1] * len(ctx), ctx, torch.float32),
        "decode_bf16": Case("decode_bf16", dec + ", bfloat16 cache", [1] * len(ctx), ctx, torch.bfloat16),
        "long_decode": Case("long_decode", f"decode, {a.long_requests} requests x {a.long_ctx} tokens of context, "
                            "float32 cache", [1] * a.long_requests, [a.long_ctx] * a.long_requests, torch.float32),
        "prefill": Case("prefill", f"prefill chunk of {a.prefill_chunk} tokens over a {a.prefill_prefix}-token "
                        "cached prefix, float32 cache", [a.prefill_chunk], [a.prefill_prefix + a.prefill_chunk],
                        torch.float32),
    }


def build_layout(q_len: list[int], kv_len: list[int], tables: list[torch.Tensor], bs: int):
    from tokenmill.layers.attention_backends import BatchLayout

    ql, kl = torch.tensor(q_len), torch.tensor(kv_len)
    table = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.long)
    slots = []
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
        pos = torch.arange(kv_len[i] - q_len[i], kv_len[i])
        slots.append(t[pos // bs] * bs + pos % bs)
    return BatchLayout(query_start=torch.cumsum(ql, 0) - ql, query_len=ql, kv_len=kl, block_table=table,
                       slot_mapping=torch.cat(slots), num_tokens=int(ql.sum()), max_query_len=int(ql.max()),
                       max_kv_len=int(kl.max()))


def make_data(c: Case, a) -> Data:
    g = torch.Generator().manual_seed(a.seed + 1)
    H, Hk, D, bs = a.heads, a.kv_heads, a.head_dim, a.block_size
    need = [-(-n // bs) for n in c.kv_len]
    pool = max(int(math.ceil(sum(need) * a.pool_factor)), sum(need)) + 1
    perm = torch.randperm(pool, generator=g)
    tables, off = [], 0
    for n in need:
        tables.append(perm[off : off + n].clone())
        off += n
    # K/V rounded to the cache dtype, so every backend and the reference see the same values.
    k_all = [torch.randn(n, Hk, D, generator=g).to(c.dtype).float() for n in c.kv_len]
    v_all = [torch.randn(n, Hk, D, generator=g).to(c.dtype).float() for n in c.kv_len]
    q = torch.randn(sum(c.q_len), H, D, generator=g)
    k = torch.cat([kk[n - m :] for kk, n, m in zip(k_all, c.kv_len, c.q_len)])
    v = torch.cat([vv[n - m :] for vv, n, m in zip(v_all, c.kv_len, c.q_len)])
    d = Data(c, H, Hk, D, bs, pool, tables, k_all, v_all, q, k, v)
    d.layout = build_layout(c.q_len, c.kv_len, tables, bs)
    return d


def dense_reference(d: Data, scale: float) -> torch.Tensor:
    """Causal softmax attention in float64 over each request's full K/V: [T, H, D]."""
    outs = []
    g = d.H // d.Hk
    for kk, vv, n, m, q in zip(d.k_all, d.v_all, d.case.kv_len, d.case.q_len, d.q.split(d.case.q_len)):
        k = kk.double().repeat_interleave(g, dim=1)
        v = vv.double().repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
        allowed = torch.arange(n).view(1, -1) <= torch.arange(n - m, n).view(-1, 1)
        s = s.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
    return torch.cat(outs)


def logical_view(backend, cache: torch.Tensor, d: Data) -> torch.Tensor | None:
    """The cache as [num_blocks, block_size, Hk, D] when its layout is one we know, else None."""
    shape = tuple(cache.shape)
    if shape == (d.pool, d.bs, d.Hk, d.D):
        return cache
    if shape == (d.pool, d.Hk, d.bs, d.D) and d.bs != d.Hk:
        return cache.transpose(1, 2)
    return None


def fill_cache(backend, layer, d: Data, chunk: int = 512) -> str:
    """Write every request's cached prefix (all but this step's tokens) into the layer's pool."""
    kv = [(n - m) for n, m in zip(d.case.kv_len, d.case.q_len)]
    kview, vview = logical_view(backend, layer.k_cache, d), logical_view(backend, layer.v_cache, d)
    if kview is not None and vview is not None:
        layer.k_cache.zero_()  # block 0 pads the tables: it must hold finite values
        layer.v_cache.zero_()
        for t, kk, vv, n in zip(d.tables, d.k_all, d.v_all, kv):
            pos = torch.arange(n)
            blk, off = t[pos // d.bs], pos % d.bs
            kview[blk, off] = kk[:n].to(kview.dtype)
            vview[blk, off] = vv[:n].to(vview.dtype)
        backend.mark_initialized(torch.arange(d.pool))
        return "direct write"
    # Unknown layout: prefill the prefixes through the backend itself, in chunks.
    done = [0] * len(kv)
    while any(c < n for c, n in zip(done, kv)):
        idx = [i for i, (c, n) in enumerate(zip(done, kv)) if c < n]
        q_len = [min(chunk, kv[i] - done[i]) for i in idx]
        kv_len = [done[i] + m for i, m in zip(idx, q_len)]
        lay = build_layout(q_len, kv_len, [d.tables[i] for i in idx], d.bs)
        k = torch.cat([d.k_all[i][done[i] : done[i] + m] for i, m in zip(idx, q_len)])
        v = torch.cat([d.v_all[i][done[i] : done[i] + m] for i, m in zip(idx, q_len)])
        q = torch.zeros(k.shape[0], d.H, d.D)
        backend.forward(layer, q, k, v, backend.build_metadata(lay))
        for i, m in zip(idx, q_len):
            done[i] += m
    return "prefilled through forward"


def run_case(c: Case, names: list[str], a, flush: torch.Tensor | None, bw: float) -> dict:
    from tokenmill.layers.attention import Attention
    from tokenmill.layers.attention_backends import get_attention_backend

    d = make_data(c, a)
    scale = a.head_dim**-0.5
    itemsize = c.dtype.itemsize
    nbytes = sum(c.kv_len) * d.Hk * d.D * 2 * itemsize
    print(f"\n== {c.name}: {c.what}; {d.H}q/{d.Hk}kv heads x {d.D}, block {d.bs}, shuffled blocks from a pool of "
          f"{d.pool}; valid K/V read per call {nbytes / 1e6:.2f} MB  {env_str()}")
    inst = {}
    for name in names:
        cls = get_attention_backend(name, CPU)
        be = cls(a.block_size, CPU)
        layer = Attention(d.H, d.Hk, d.D, scale)
        be.allocate_kv_cache([layer], d.pool, c.dtype)
        t = time.perf_counter()
        how = fill_cache(be, layer, d)
        # build_metadata once per step (all layers share it); time it apart from the layer call.
        meta_times = []
        for _ in range(max(3, a.warmup)):
            t0 = time.perf_counter()
            meta = be.build_metadata(d.layout)
            meta_times.append(time.perf_counter() - t0)
        inst[name] = (be, layer, meta, statistics.median(meta_times[1:]))
        print(f"  {name}: cache {tuple(layer.k_cache.shape)} {str(c.dtype).removeprefix('torch.')}, filled by {how} "
              f"in {time.perf_counter() - t:.2f} s")

    def call(name):
        be, layer, meta, _ = inst[name]
        return be.forward(layer, d.q, d.k, d.v, meta)

    with torch.inference_mode():
        for name in names:
            for _ in range(a.warmup):
                call(name)
            d.outs[name] = call(name).float()
        times = {name: [] for name in names}
        watch = OtherLoad()
        for _ in range(a.repeats):
            for name in names:
                if flush is not None:
                    flush.sum()
                t0 = time.perf_counter()
                call(name)
                times[name].append(time.perf_counter() - t0)
    others = watch.cores()
    ref = dense_reference(d, scale)
    base = a.baseline if a.baseline in names else names[0]
    res = {"case": c.name, "what": c.what, "kv_bytes": nbytes, "backends": {}}
    print(f"  {'backend':<12} {'metadata ms':>11} {'forward ms':>10} {'(min-max)':>17} {'GB/s':>7} {'% stream':>8} "
          f"{'max|d| vs ' + base:>22} {'max|err| vs fp64':>16}")
    for name in names:
        ts = times[name]
        med = statistics.median(ts)
        gbs = nbytes / med / 1e9
        diff = (d.outs[name] - d.outs[base]).abs().max().item()
        err = (d.outs[name].double() - ref).abs().max().item()
        e = env()
        res["backends"][name] = {"forward_ms": 1e3 * med, "forward_ms_min": 1e3 * min(ts),
                                 "forward_ms_max": 1e3 * max(ts),
                                 "metadata_ms": 1e3 * inst[name][3], "gb_s": gbs, "share_of_stream_bw": gbs * 1e9 / bw,
                                 "max_abs_diff_vs_baseline": diff, "max_abs_err_vs_fp64": err, **e}
        spread = f"({1e3 * min(ts):.3f}-{1e3 * max(ts):.3f})"
        print(f"  {name:<12} {1e3 * inst[name][3]:11.3f} {1e3 * med:10.3f} {spread:>17} "
              f"{gbs:7.2f} {100 * gbs * 1e9 / bw:7.1f}% {diff:22.2e} {err:16.2e}  {env_str(e)}")
    for name in names:
        if name != base:
            r = res["backends"][base]["forward_ms"] / res["backends"][name]["forward_ms"]
            res["backends"][name]["speedup_vs_baseline"] = r
            print(f"  ratio {name} vs {base}: {r:.2f}x ({base} ms / {name} ms)  {env_str()}")
    busy = warn_if_busy(others, "during the timed calls")
    if busy:
        print("  " + busy)
    res["other_processes_cores"] = others
    del inst, d
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default=None, help="comma list (default: available_backends('cpu'))")
    ap.add_argument("--baseline", default="torch_sdpa", help="ratios and diffs against this backend")
    ap.add_argument("--cases", default=",".join(ALL_CASES), help=f"comma list of {', '.join(ALL_CASES)}")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per backend (median reported)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--bw-gib", type=float, default=1.0, help="size of the bandwidth probe tensor")
    ap.add_argument("--flush-mb", type=int, default=64, help="buffer read before each timed call (0: warm caches)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pool-factor", type=float, default=2.0, help="pool blocks / blocks the requests use")
    ap.add_argument("--decode-requests", type=int, default=64)
    ap.add_argument("--decode-ctx", type=lambda s: tuple(int(x) for x in s.split(",")), default=(200, 400),
                    metavar="LO,HI", help="decode context lengths, uniform in [LO, HI]")
    ap.add_argument("--long-requests", type=int, default=4)
    ap.add_argument("--long-ctx", type=int, default=8192)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--prefill-prefix", type=int, default=1024)
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    ap.add_argument("--no-tune-malloc", action="store_true",
                    help="leave glibc's adaptive malloc thresholds (default: fixed, as tokenmill's own processes do)")
    a = ap.parse_args()

    if a.threads:
        torch.set_num_threads(a.threads)
    tuned = False
    if not a.no_tune_malloc:
        from tokenmill.platform import tune_malloc

        tuned = tune_malloc()
    from tokenmill.layers.attention_backends import available_backends

    avail = available_backends(CPU)
    names = [n.strip() for n in a.backends.split(",") if n.strip()] if a.backends else avail
    missing = [n for n in names if n not in avail]
    if missing:
        from tokenmill import native

        why = f" (native kernels: {native.load()})" if native.load() else ""
        raise SystemExit(f"backend(s) {', '.join(missing)} not available on CPU{why}; available: {', '.join(avail)}")
    cases = [s.strip() for s in a.cases.split(",") if s.strip()]
    bad = [s for s in cases if s not in ALL_CASES]
    if bad:
        raise SystemExit(f"unknown case(s) {', '.join(bad)}; choose from {', '.join(ALL_CASES)}")
    if a.baseline not in names:
        print(f"note: baseline {a.baseline} not among the backends; comparing against {names[0]}")

    e0 = env()
    whole = OtherLoad()
    bw = measure_bandwidth(int(a.bw_gib * (1 << 30)))
    print(f"torch {torch.__version__}, backends: {', '.join(names)} (available on CPU: {', '.join(avail)})")
    print(f"streaming read bandwidth: {bw / 1e9:.1f} GB/s (best of 5 sums over {a.bw_gib:g} GiB float32)  "
          f"{env_str(e0)}")
    print(f"timing: median of {a.repeats} calls after {a.warmup} warm-up, backends interleaved, "
          + (f"{a.flush_mb} MB read before each call (cold caches)" if a.flush_mb else "warm caches")
          + f"; malloc thresholds {'fixed (tokenmill.platform.tune_malloc)' if tuned else 'glibc adaptive'}")
    flush = torch.ones((a.flush_mb << 20) // 4) if a.flush_mb else None
    all_cases = make_cases(a)
    results = [run_case(all_cases[c], names, a, flush, bw) for c in cases]

    print("\nsummary (forward ms per layer call, median; ratio = baseline ms / backend ms):")
    base = a.baseline if a.baseline in names else names[0]
    head = "".join(f"{n:>14}" for n in names)
    print(f"  {'case':<13}{head}" + "".join(f"{'x vs ' + base:>18}" for n in names if n != base))
    for r in results:
        b = r["backends"]
        row = "".join(f"{b[n]['forward_ms']:14.3f}" for n in names)
        row += "".join(f"{b[n]['speedup_vs_baseline']:17.2f}x" for n in names if n != base)
        print(f"  {r['case']:<13}{row}")
    print(f"  bandwidth {bw / 1e9:.1f} GB/s; {env_str()}")
    print("  " + warn_if_busy(whole.cores(), "during the whole run"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"stream_bandwidth_bytes_s": bw, "env_start": e0, "env_end": env(), "args": vars(a),
                       "results": results}, f, indent=1, default=str)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
