"""Conformance of the native cpu_paged attention kernel against dense reference attention in float64,
on random paged layouts: ragged contexts, shuffled block tables, cached prefixes, chunked prompts mixed
with decodes, sliding windows, soft caps, GQA ratios, head sizes, float32 and bfloat16 caches.

Every cache slot a request may not see is NaN, so reading one (padding, another request's block, a slot
past the context) poisons the output and fails the test."""
from __future__ import annotations

import math

import pytest
import torch

from tokenmill import native
from tokenmill.layers.attention import Attention
from tokenmill.layers.attention_backends import BatchLayout, get_attention_backend
from test_attention_backends import dense_reference

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels not built: {native.load()}")


def make_case(seed, ctx_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size=16, dtype=torch.float32):
    """Random caches with each request's cached prefix written; returns the layout and step tensors."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_req = [math.ceil(c / block_size) for c in ctx_lens]
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=g)
    tables, used = [], 0
    for nb in blocks_per_req:
        tables.append(perm[used:used + nb])
        used += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    full_k, full_v = [], []  # per request: [ctx, Hk, D] float64 after rounding to the cache dtype
    for t, c in zip(tables, ctx_lens):
        kk = torch.randn(c, num_kv_heads, head_dim, generator=g)
        vv = torch.randn(c, num_kv_heads, head_dim, generator=g)
        full_k.append(kk.to(dtype).double())
        full_v.append(vv.to(dtype).double())
        slots = t.repeat_interleave(block_size) * block_size + torch.arange(block_size).repeat(len(t))
        slots = slots[:c]
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = kk.to(dtype)
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = vv.to(dtype)
        # The new tokens of this step are written by the kernel itself: clear them again.
    new_k, new_v, slot_map = [], [], []
    for t, c, ql, kk, vv in zip(tables, ctx_lens, q_lens, full_k, full_v):
        slots = (t.repeat_interleave(block_size) * block_size + torch.arange(block_size).repeat(len(t)))[c - ql:c]
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = float("nan")
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = float("nan")
        new_k.append(kk[c - ql:].float())
        new_v.append(vv[c - ql:].float())
        slot_map.append(slots)
    T = sum(q_lens)
    q = torch.randn(T, num_heads, head_dim, generator=g)
    max_nb = max(blocks_per_req)
    bt = torch.zeros(len(ctx_lens), max_nb, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = t.to(torch.int32)
    ql_t = torch.tensor(q_lens)
    layout = BatchLayout(
        query_start=torch.cumsum(ql_t, 0) - ql_t, query_len=ql_t, kv_len=torch.tensor(ctx_lens), block_table=bt,
        slot_mapping=torch.cat(slot_map), num_tokens=T, max_query_len=max(q_lens), max_kv_len=max(ctx_lens))
    return q, torch.cat(new_k), torch.cat(new_v), k_cache, v_cache, layout, full_k, full_v


def reference(q, full_k, full_v, q_lens, scale, window, cap):
    """Each request's rows through the dense float64 reference of the backend conformance suite."""
    out, row = [], 0
    for kk, vv, ql in zip(full_k, full_v, q_lens):
        out.append(dense_reference(q[row:row + ql].double(), kk, vv, scale, window, cap))
        row += ql
    return torch.cat(out)


def run_backend(q, k, v, k_cache, v_cache, layout, num_heads, num_kv_heads, head_dim, window=None, cap=None):
    backend = get_attention_backend("cpu_paged", "cpu")(k_cache.shape[1], torch.device("cpu"))
    layer = Attention(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, sliding_window=window, logits_soft_cap=cap)
    layer.k_cache, layer.v_cache, layer.backend = k_cache, v_cache, backend
    meta = backend.build_metadata(layout)
    return layer(q, k, v, meta), layer.scale


def random_lens(g, n, lo, hi):
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


CASES = [  # (num_heads, num_kv_heads, head_dim): GQA ratios 1, 3 and 8; head sizes 64, 80, 128 (and 96, 256)
    (4, 4, 64), (9, 3, 64), (8, 1, 128), (6, 2, 80), (3, 1, 96), (2, 1, 256),
]


@pytest.mark.parametrize("heads", CASES, ids=lambda h: f"H{h[0]}-Hk{h[1]}-D{h[2]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_mixed_batch_matches_reference(heads, dtype):
    """Decodes with ragged contexts up to 2,000, prompt chunks over cached prefixes, a whole prompt."""
    H, Hk, D = heads
    g = torch.Generator().manual_seed(H * 100 + D)
    ctx = random_lens(g, 5, 1, 2000) + [1, 17, 300, 300, 1000, 37]
    ql = [1] * 7 + [150, 45, 1000, 37]  # chunk after a prefix hit, a chunk, a long chunk, a whole prompt
    q, k, v, kc, vc, layout, fk, fv = make_case(D + H, ctx, ql, H, Hk, D, dtype=dtype)
    out, scale = run_backend(q, k, v, kc, vc, layout, H, Hk, D)
    ref = reference(q, fk, fv, ql, scale, None, None)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("window", [1, 7, 64, 500])
def test_sliding_window(window):
    H, Hk, D = 8, 2, 64
    ctx = [1, 30, 64, 65, 700, 1500, 200, 900]
    ql = [1, 1, 1, 1, 1, 1, 200, 333]
    q, k, v, kc, vc, layout, fk, fv = make_case(window, ctx, ql, H, Hk, D)
    # Keys that slid out of every query's window may hold anything: poison them too.
    for t, c, n in zip(layout.block_table, ctx, ql):
        first_visible = max(0, c - n - window + 1)
        for pos in range(first_visible):
            b, off = int(t[pos // 16]), pos % 16
            kc[b, off] = float("nan")
            vc[b, off] = float("nan")
    out, scale = run_backend(q, k, v, kc, vc, layout, H, Hk, D, window=window)
    ref = reference(q, fk, fv, ql, scale, window, None)
    assert (out.double() - ref).abs().max().item() <= 1e-5


def test_soft_cap_and_long_single_request_split():
    """One long decode (split over partitions and merged) and a chunk, with Gemma's logit soft cap."""
    H, Hk, D = 4, 1, 256
    ctx, ql = [2000, 1900, 120], [1, 1, 120]
    q, k, v, kc, vc, layout, fk, fv = make_case(3, ctx, ql, H, Hk, D)
    q = q * 8  # large scores, so the cap matters
    out, scale = run_backend(q, k, v, kc, vc, layout, H, Hk, D, cap=5.0)
    ref = reference(q, fk, fv, ql, scale, None, 5.0)
    assert (out.double() - ref).abs().max().item() <= 1e-5
    plain = reference(q, fk, fv, ql, scale, None, None)
    assert (plain - ref).abs().max().item() > 1e-2  # the cap changed the answer


def test_writes_new_kv_into_the_cache():
    H, Hk, D = 4, 2, 64
    ctx, ql = [40, 5], [3, 5]
    q, k, v, kc, vc, layout, fk, fv = make_case(5, ctx, ql, H, Hk, D, dtype=torch.bfloat16)
    run_backend(q, k, v, kc, vc, layout, H, Hk, D)
    flat_k, flat_v = kc.view(-1, Hk, D), vc.view(-1, Hk, D)
    assert torch.equal(flat_k[layout.slot_mapping], k.to(torch.bfloat16))
    assert torch.equal(flat_v[layout.slot_mapping], v.to(torch.bfloat16))


def test_threads_do_not_change_the_answer():
    H, Hk, D = 9, 3, 64
    ctx, ql = [1200, 300, 77, 600], [1, 1, 77, 100]
    q, k, v, kc, vc, layout, fk, fv = make_case(11, ctx, ql, H, Hk, D)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = run_backend(q, k, v, kc.clone(), vc.clone(), layout, H, Hk, D)
        torch.set_num_threads(max(2, before))
        many, _ = run_backend(q, k, v, kc.clone(), vc.clone(), layout, H, Hk, D)
    finally:
        torch.set_num_threads(before)
    assert (one - many).abs().max().item() <= 1e-6


@pytest.mark.parametrize("ctx", [[170], [1300], [90, 40]], ids=["one-short", "one-split", "two-short"])
def test_few_decodes_split_by_heads_on_two_threads(ctx):
    """One or two decodes are fewer items than threads: they split by KV heads (32 of them, as a 1.7B MHA model
    has) and, for a long context, by partition too. Each head's arithmetic is unchanged: bit for bit the one
    thread answer where the partitions are the same (short contexts; a long one is cut by the thread count, as
    before), and the float64 reference's."""
    H, Hk, D = 32, 32, 64
    ql = [1] * len(ctx)
    q, k, v, kc, vc, layout, fk, fv = make_case(5, ctx, ql, H, Hk, D)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, scale = run_backend(q, k, v, kc.clone(), vc.clone(), layout, H, Hk, D)
        torch.set_num_threads(2)
        two, _ = run_backend(q, k, v, kc.clone(), vc.clone(), layout, H, Hk, D)
    finally:
        torch.set_num_threads(before)
    if max(ctx) < 256:  # one partition per request whatever the threads
        assert torch.equal(one, two)
    assert (one - two).abs().max().item() <= 1e-6
    want = reference(q, fk, fv, ql, scale, None, None)
    assert (two.double() - want).abs().max().item() < 1e-4


def test_rejects_unsupported_cache_dtype():
    backend = get_attention_backend("cpu_paged", "cpu")(16, torch.device("cpu"))
    layer = Attention(2, 1, 64, 0.125)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        backend.allocate_kv_cache([layer], 4, torch.float16)


@pytest.mark.parametrize("seed", range(6))
def test_random_layouts(seed):
    """Random geometry, window, cap and cache dtype; ragged decodes and chunks in one batch."""
    g = torch.Generator().manual_seed(1000 + seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    Hk, ratio, D = pick([1, 2, 4]), pick([1, 3, 8]), pick([64, 128])
    window = pick([None, None, 16, 300])
    cap = pick([None, None, 30.0])
    dtype = pick([torch.float32, torch.bfloat16])
    block_size = pick([16, 32])
    n = int(torch.randint(1, 9, (1,), generator=g))
    ctx = random_lens(g, n, 1, 2000)
    ql = [1 if torch.rand(1, generator=g) < 0.6 else int(torch.randint(1, c + 1, (1,), generator=g)) for c in ctx]
    H = Hk * ratio
    q, k, v, kc, vc, layout, fk, fv = make_case(seed, ctx, ql, H, Hk, D, block_size=block_size, dtype=dtype)
    out, scale = run_backend(q, k, v, kc, vc, layout, H, Hk, D, window=window, cap=cap)
    ref = reference(q, fk, fv, ql, scale, window, cap)
    assert (out.double() - ref).abs().max().item() <= 1e-5


def test_bf16_queries_come_back_in_bf16():
    """Models computing in bf16 (CPUs with native bf16) pass bf16 q/k/v: attention runs in float32 inside."""
    H, Hk, D = 4, 2, 64
    ctx, ql = [90, 33], [1, 33]
    q, k, v, kc, vc, layout, fk, fv = make_case(21, ctx, ql, H, Hk, D, dtype=torch.bfloat16)
    out, scale = run_backend(q.bfloat16(), k.bfloat16(), v.bfloat16(), kc, vc, layout, H, Hk, D)
    assert out.dtype == torch.bfloat16
    ref = reference(q.bfloat16().float(), fk, fv, ql, scale, None, None)
    assert (out.double() - ref).abs().max().item() <= 2e-2


def relayout(k_cache, v_cache, layout, block_size):
    """The same requests' K/V in a cache of another block size (block tables reversed, so blocks lie apart)."""
    Hk, D = k_cache.shape[2], k_cache.shape[3]
    old_bs = k_cache.shape[1]
    kv_len = layout.kv_len.tolist()
    counts = [math.ceil(c / block_size) for c in kv_len]
    n = sum(counts)
    ids = list(range(n))[::-1]  # blocks handed out from the end of the pool
    tables = [ids[sum(counts[:i]): sum(counts[: i + 1])] for i in range(len(counts))]
    kc = torch.full((n, block_size, Hk, D), float("nan"), dtype=k_cache.dtype)
    vc = torch.full_like(kc, float("nan"))
    bt = torch.zeros(len(kv_len), max(len(t) for t in tables), dtype=torch.int32)
    slots_new = []
    for r, (t, c) in enumerate(zip(tables, kv_len)):
        bt[r, :len(t)] = torch.tensor(t, dtype=torch.int32)
        old = layout.block_table[r].long()
        pos = torch.arange(c)
        src = old[pos // old_bs] * old_bs + pos % old_bs
        dst = torch.tensor(t)[pos // block_size] * block_size + pos % block_size
        kc.view(-1, Hk, D)[dst] = k_cache.view(-1, Hk, D)[src]
        vc.view(-1, Hk, D)[dst] = v_cache.view(-1, Hk, D)[src]
        slots_new.append(dst[c - int(layout.query_len[r]):])
    new = BatchLayout(query_start=layout.query_start, query_len=layout.query_len, kv_len=layout.kv_len,
                      block_table=bt, slot_mapping=torch.cat(slots_new), num_tokens=layout.num_tokens,
                      max_query_len=layout.max_query_len, max_kv_len=layout.max_kv_len)
    return kc, vc, new


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("heads", [(9, 3, 64), (6, 2, 80), (4, 4, 64)], ids=lambda h: f"H{h[0]}-Hk{h[1]}-D{h[2]}")
def test_decode_bit_identical_across_block_sizes(dtype, heads):
    """The decode K pass scores tokens four at a time inside a block where it can (AVX-512: dot_heads4,
    hsum4), one at a time elsewhere; both must give each score bit for bit. Block sizes 16, 5 and 3 group the
    same tokens differently; the same keys and values must give exactly the same output."""
    H, Hk, D = heads
    ctx, ql = [37, 64, 101, 5], [1, 1, 1, 1]
    q, k, v, kc16, vc16, layout16, fk, fv = make_case(3, ctx, ql, H, Hk, D, block_size=16, dtype=dtype)
    outs = []
    for bs in (16, 5, 3):
        kc, vc, layout = relayout(kc16, vc16, layout16, bs)
        out, scale = run_backend(q, k, v, kc, vc, layout, H, Hk, D)
        outs.append(out)
        assert (out.double() - reference(q, fk, fv, ql, scale, None, None)).abs().max().item() <= 1e-5
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
