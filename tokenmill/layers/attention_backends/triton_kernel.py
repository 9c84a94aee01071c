"""The Triton kernel of the `triton_paged` backend (imported only when the backend runs: Triton is optional).

One kernel for prompt chunks and decodes alike: a program attends BLOCK_M query rows of one request for one
query head, over that request's keys read through its block table BLOCK_N positions at a time (any page size:
each key position finds its page), with an online softmax in float32 (FlashAttention's recurrence). Causality
counts slots (a query at slot c + i sees keys up to c + i), a sliding window bounds the keys from below, an
optional soft cap squashes the scores (Gemma 2), optional sinks (gpt-oss: a logit per query head) join the
softmax's denominator when a row is normalised (exp(sink - m) added to its sum), and the cache may hold float32 / bfloat16 / float16 values,
int8 with a float32 scale per slot and KV head, or fp8 e4m3 bytes with one scale per layer (decoded here from
their bits, so the same code runs under TRITON_INTERPRET=1 on the CPU, where numpy has no fp8).

Float32 queries multiply exactly (`input_precision="ieee"`, unless torch itself allows tf32): tl.dot's tf32
default is ~1e-3 off, enough to flip a greedy token of a float32 model (seen on an H200: docs/gpu.md).

Keys past a request's kv_len are never loaded (masked loads read 0), so unwritten slots of a fresh pool (NaN
garbage) cannot reach the output and the pool needs no zeroing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FLOAT, INT8, FP8 = 0, 1, 2  # KV_FORMAT


@triton.jit
def _fp8_e4m3_to_float(b):
    """uint8 bits of float8_e4m3fn -> float32 (saturating writes never store its NaN)."""
    b = b.to(tl.int32)
    sign = tl.where((b & 0x80) != 0, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    mant = (b & 0x7).to(tl.float32)
    normal = (1.0 + mant / 8.0) * tl.exp2((exp - 7).to(tl.float32))
    subnormal = mant / 8.0 * 0.015625  # 2^-6
    return sign * tl.where(exp == 0, subnormal, normal)


@triton.jit
def _load_kv(ptr, scale_ptr, slot, kvh, offs_d, n_ok, d_ok, scale, NUM_KV_HEADS: tl.constexpr,
             HEAD_DIM: tl.constexpr, KV_FORMAT: tl.constexpr):
    """[BLOCK_N, BLOCK_D] float32 keys or values at `slot` for KV head kvh (0 where n_ok or d_ok is false)."""
    x = tl.load(ptr + (slot[:, None] * NUM_KV_HEADS + kvh) * HEAD_DIM + offs_d[None, :],
                mask=n_ok[:, None] & d_ok[None, :], other=0)
    if KV_FORMAT == 1:
        s = tl.load(scale_ptr + slot * NUM_KV_HEADS + kvh, mask=n_ok, other=0.0)
        return x.to(tl.float32) * s[:, None]
    elif KV_FORMAT == 2:
        return _fp8_e4m3_to_float(x) * scale
    else:
        return x.to(tl.float32)


@triton.jit
def paged_attention_kernel(
    Q, K, V, K_SCALES, V_SCALES, OUT, SINKS,
    block_table, tile_req, tile_first, query_start, query_len, kv_len,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    sm_scale, soft_cap, k_scale, v_scale, window,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, KV_FORMAT: tl.constexpr, IEEE_F32: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // GROUP
    req = tl.load(tile_req + tile)
    first = tl.load(tile_first + tile)  # the tile's first query, counted within its request
    q0 = tl.load(query_start + req)
    ql = tl.load(query_len + req)
    kl = tl.load(kv_len + req)
    context = kl - ql

    offs_m = first + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < ql
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + (q0 + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    q_pos = context + offs_m  # each query's slot in its sequence

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(kl, context + first + BLOCK_M)  # past the tile's last query: nothing visible
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(context + first - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kl
        page = tl.load(block_table + req * stride_bt + offs_n // PAGE, mask=n_ok, other=0)
        slot = page.to(tl.int64) * PAGE + offs_n % PAGE
        k = _load_kv(K, K_SCALES, slot, kvh, offs_d, n_ok, d_ok, k_scale, NUM_KV_HEADS, HEAD_DIM, KV_FORMAT)
        if IEEE_F32:  # float32 queries: exact products, as torch computes them (tl.dot's default is tf32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
        else:
            s = tl.dot(q, tl.trans(k)) * sm_scale
        if HAS_CAP:  # cap * tanh(s / cap), tanh from exp (portable to the interpreter)
            s = soft_cap * (2.0 / (1.0 + tl.exp(-2.0 * s / soft_cap)) - 1.0)
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = _load_kv(V, V_SCALES, slot, kvh, offs_d, n_ok, d_ok, v_scale, NUM_KV_HEADS, HEAD_DIM, KV_FORMAT)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    if HAS_SINKS:  # every row has seen its own key, so m_i is finite
        l_i = l_i + tl.exp(tl.load(SINKS + head) - m_i)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(OUT + (q0 + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def launch(q, k_cache, v_cache, k_scales, v_scales, out, block_table, tile_req, tile_first, query_start, query_len,
           kv_len, scale: float, soft_cap: float | None, k_scale: float, v_scale: float, window: int | None,
           kv_format: int, block_m: int, block_n: int, sinks: torch.Tensor | None = None) -> None:
    """q, out: [T, H, D]; caches [num_blocks, page, Hk, D] (fp8: their uint8 view); one program per (tile, head)."""
    T, H, D = q.shape
    Hk, page = k_cache.shape[2], k_cache.shape[1]
    grid = (tile_req.numel(), H)
    exact_f32 = q.dtype == torch.float32 and not (q.is_cuda and torch.backends.cuda.matmul.allow_tf32)
    paged_attention_kernel[grid](
        q, k_cache, v_cache, k_scales if k_scales is not None else k_cache,
        v_scales if v_scales is not None else v_cache, out, sinks if sinks is not None else out,
        block_table, tile_req, tile_first, query_start, query_len, kv_len,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        scale, soft_cap or 1.0, k_scale, v_scale, window or 0,
        NUM_KV_HEADS=Hk, GROUP=H // Hk, HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)), PAGE=page,
        BLOCK_M=block_m, BLOCK_N=block_n, HAS_WINDOW=window is not None, HAS_CAP=soft_cap is not None,
        KV_FORMAT=kv_format, IEEE_F32=exact_f32, HAS_SINKS=sinks is not None,
    )
