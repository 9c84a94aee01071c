"""The tests' own GPTQ / AWQ / FP8 packers, written from the published layouts (independently of
tokenmill's unpacking): quantize a float [N, K] weight, return the checkpoint tensors and the float
weight they stand for (what a dequantizing reader must get back)."""
from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FP8_MAX = 448.0


def _words(nibbles: list[torch.Tensor]) -> torch.Tensor:
    """Eight equal-shape nibble tensors -> int32 words, nibble j in bits 4j..4j+3."""
    acc = torch.zeros_like(nibbles[0], dtype=torch.int64)
    for j, v in enumerate(nibbles):
        acc |= v.to(torch.int64) << (4 * j)
    return torch.where(acc >= 2**31, acc - 2**32, acc).to(torch.int32).contiguous()  # the same 32 bits, signed


def quantize_groups(w: torch.Tensor, group: int, symmetric: bool, min_zero: int = 0):
    """w [N, K] -> q [N, K] (0..15), scale fp16 [N, G], zero [N, G] (integers), deq [N, K] float32."""
    N, K = w.shape
    g = w.float().reshape(N, K // group, group)
    if symmetric:
        scale = (g.abs().amax(-1) * 2 / 15).clamp(min=1e-6).half()
        zero = torch.full(scale.shape, 8.0)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-6).half()
        zero = torch.round(-lo / scale.float()).clamp(min_zero, 15)
    q = (torch.round(g / scale.float()[..., None]) + zero[..., None]).clamp(0, 15)
    deq = ((q - zero[..., None]) * scale.float()[..., None]).reshape(N, K)
    return q.reshape(N, K).to(torch.uint8), scale, zero.to(torch.uint8), deq


def gptq_pack(w: torch.Tensor, group: int, symmetric: bool, v1: bool = True, act_order: torch.Tensor | None = None):
    """AutoGPTQ layout: qweight [K/8, N] packed along K, qzeros [K/g, N/8] packed along N (v1: zero - 1),
    scales [K/g, N], g_idx [K]. group -1: one group over K. `act_order`: a permutation of the K columns,
    quantized in that order (desc_act): group j holds columns act_order[j*g:(j+1)*g]."""
    N, K = w.shape
    g = K if group == -1 else group
    perm = torch.arange(K) if act_order is None else act_order
    inv = torch.argsort(perm)
    q, scale, zero, deq = quantize_groups(w[:, perm], g, symmetric, min_zero=1 if v1 else 0)
    q, deq = q[:, inv], deq[:, inv]  # back to the columns' own order
    qk = q.T  # [K, N]
    qweight = _words([qk[j::8] for j in range(8)])  # row i: inputs 8i..8i+7
    stored = (zero.to(torch.int64) - (1 if v1 else 0)).T  # [G, N]
    qzeros = _words([stored[:, j::8] for j in range(8)])
    g_idx = (inv // g).to(torch.int32)  # column k sits at position inv[k] of the quantization order
    return {"qweight": qweight, "qzeros": qzeros, "scales": scale.T.contiguous(), "g_idx": g_idx}, deq, scale


def awq_pack(w: torch.Tensor, group: int, symmetric: bool):
    """AutoAWQ GEMM layout: qweight [K, N/8] and qzeros [K/g, N/8] packed along N in AWQ_ORDER,
    scales [K/g, N]."""
    q, scale, zero, deq = quantize_groups(w, group, symmetric)
    qk, zk = q.T, zero.T  # [K, N], [G, N]
    qweight = _words([qk[:, AWQ_ORDER[j]::8] for j in range(8)])
    qzeros = _words([zk[:, AWQ_ORDER[j]::8] for j in range(8)])
    return {"qweight": qweight, "qzeros": qzeros, "scales": scale.T.contiguous()}, deq, scale


def fp8_pack(w: torch.Tensor, per_channel: bool, scale_shape: str = "n1"):
    """weight float8_e4m3fn [N, K], weight_scale float32: [] (per tensor) or [N, 1] / [N] (per channel)."""
    w = w.float()
    if per_channel:
        scale = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    else:
        scale = w.abs().amax().clamp(min=1e-12) / FP8_MAX
    q = (w / scale).to(torch.float8_e4m3fn)
    deq = q.float() * scale
    stored = scale if per_channel and scale_shape == "n1" else scale.reshape(-1) if per_channel else scale.reshape(())
    return {"weight": q, "weight_scale": stored}, deq, scale
