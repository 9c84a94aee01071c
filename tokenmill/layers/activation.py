from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.layers import fused

# activation name -> (fused kernel name or None, torch function)
_ACTS = {
    "silu": ("silu", F.silu),
    "swish": ("silu", F.silu),
    "gelu_pytorch_tanh": ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh")),
    "gelu_tanh": ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh")),
    "gelu": (None, F.gelu),
}


def act_fn(name: str):
    if name not in _ACTS:
        raise ValueError(f"unsupported activation {name!r}")
    return _ACTS[name][1]


def gated(gate_up: torch.Tensor, act, name: str | None = None) -> torch.Tensor:
    """act(gate) * up; with `name` (a key of the table above) the fused kernel where it applies."""
    kernel = _ACTS[name][0] if name is not None else None
    if kernel is not None:
        return fused.act_and_mul(gate_up, kernel, act)
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up
