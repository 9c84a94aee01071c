"""The decoder's small elementwise ops: one native kernel each (csrc/fused_ops.cpp) for float32 and bfloat16
on the CPU, and the torch reference for everything else. At batch 1 a layer's weights take tens of µs to read,
while its dozen unfused torch ops (pow, mean, rsqrt, mul, cat, neg, silu, ...) each cost a dispatch and an
allocation: fusing them is what lets quantized decoding approach the weights' bandwidth.

bf16 rows are computed in float32 and rounded once on the way out, where the torch reference rounds after
each op (the residual sum is rounded before the norm in both): the same results within a bf16 rounding.

TOKENMILL_FUSED_OPS=0 turns the kernels off (same results within float rounding)."""
from __future__ import annotations

import os

import torch

ENABLED = os.environ.get("TOKENMILL_FUSED_OPS", "1") != "0"
_HAVE: bool | None = None


def _native(x: torch.Tensor) -> bool:
    global _HAVE
    if not ENABLED or x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        return False
    if _HAVE is None:
        from tokenmill import native

        _HAVE = native.has_op("add_rms_norm")
    return _HAVE


# ---- torch references ----------------------------------------------------------------------
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float()
    if offset:
        w = w + offset
    return (x * w).to(dtype)


def rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos[positions].unsqueeze(1).to(q.dtype)
    sin = sin[positions].unsqueeze(1).to(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# ---- dispatch ------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm over the last dim, times (offset + weight)."""
    if _native(x) and weight.is_floating_point():
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        return torch.ops.tokenmill.rms_norm(x2, weight, eps, offset).view(x.shape)
    return rms_norm_ref(x, weight, eps, offset)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float,
                 offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, rms_norm(x + h)): the residual add and the next norm in one pass."""
    if _native(x) and h.dtype == x.dtype and weight.is_floating_point() and x.dim() == 2:
        return torch.ops.tokenmill.add_rms_norm(x, h, weight, eps, offset)
    s = x + h
    return s, rms_norm_ref(s, weight, eps, offset)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding of q [T, H, D] and k [T, Hk, D] at `positions`."""
    if _native(q) and k.dtype == q.dtype and cos.dtype == torch.float32 and q.stride(-1) == 1 \
            and k.stride(-1) == 1:
        return torch.ops.tokenmill.rotary(q, k, positions, cos, sin)
    return rotary_ref(q, k, positions, cos, sin)


def act_and_mul(gate_up: torch.Tensor, name: str, act) -> torch.Tensor:
    """act(gate) * up, with gate and up the two halves of the last dim."""
    if name in ("silu", "gelu_tanh") and _native(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        op = torch.ops.tokenmill.silu_and_mul if name == "silu" else torch.ops.tokenmill.gelu_tanh_and_mul
        return op(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up
