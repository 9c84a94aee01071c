"""Rotary position embedding with a cos/sin table, for the rope types transformers defines
(default, linear, dynamic, yarn, llama3, longrope): the inverse frequencies come from
transformers' own rope initialisers so the positions match the oracle."""
from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.layers import fused
from tokenmill.model.hf_config import hf_get


def rope_inv_freq(hf_config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    # rope_parameters (newer transformers) or rope_theta (older)
    params = hf_get(hf_config, "rope_parameters") or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", hf_get(hf_config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None, **kwargs)
    return inv_freq.float(), float(scale)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `factor` times the original (transformers' yarn_get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_softmax_scale(hf_config, scale: float) -> float:
    """The softmax scale of MLA (DeepSeek-V2/V3) under a scaled rope: YaRN's cos/sin already carry their
    attention factor (rope_inv_freq's second value); these models also multiply the whole q.k (the non-rotary
    features too) by mscale(factor, mscale_all_dim) squared, as transformers' yarn_apply_mscale does."""
    params = hf_get(hf_config, "rope_parameters") or {}
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        return scale * m * m
    return scale


class RotaryEmbedding(nn.Module):
    """The table's width is 2 * len(inv_freq): `rotary_dim`. A head wider than that (partial rotary, Phi-4-mini's
    partial_rotary_factor) has only its first rotary_dim features rotated, the rest passed through, as
    transformers does. `interleaved` (GLM's GPT-J style) pairs features (2i, 2i+1) instead of (i, i + rotary_dim/2):
    the same rotation applied to the features reordered evens-then-odds, and ordered back."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, scaling: float = 1.0,
                 interleaved: bool = False) -> None:
        super().__init__()
        self.rotary_dim = rd = 2 * inv_freq.numel()
        self.interleaved = interleaved
        if interleaved:
            order = torch.cat([torch.arange(0, rd, 2), torch.arange(1, rd, 2)])
            self.register_buffer("order", order, persistent=False)
            self.register_buffer("unorder", torch.argsort(order), persistent=False)
        t = torch.arange(max_positions, dtype=torch.float)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, Hk, D], positions: [T]. Rotate-half convention (as transformers)."""
        rd = self.rotary_dim
        if rd == q.shape[-1] and not self.interleaved:
            return fused.rotary(q, k, positions, self.cos, self.sin)
        qr, kr = q[..., :rd], k[..., :rd]  # strided views: no copy
        if self.interleaved:
            qr, kr = qr[..., self.order], kr[..., self.order]
        qr, kr = fused.rotary(qr, kr, positions, self.cos, self.sin)
        if self.interleaved:
            qr, kr = qr[..., self.unorder], kr[..., self.unorder]
        if rd == q.shape[-1]:
            return qr, kr
        return torch.cat([qr, q[..., rd:]], dim=-1), torch.cat([kr, k[..., rd:]], dim=-1)
