"""Attention backends by name; the device picks the default, `--attention-backend` overrides it."""
from __future__ import annotations

import torch

from tokenmill.layers.attention_backends.base import AttentionBackend

_BACKENDS: dict[str, type[AttentionBackend]] = {}
_DEFAULTS: dict[str, str] = {"cpu": "torch_sdpa", "cuda": "torch_sdpa"}
_FALLBACK = "torch_sdpa"  # runs on any device torch does


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    if cls.name in _BACKENDS and _BACKENDS[cls.name] is not cls:
        raise ValueError(f"attention backend {cls.name!r} is already registered")
    _BACKENDS[cls.name] = cls
    return cls


def available_backends(device: torch.device | str) -> list[str]:
    device = torch.device(device)
    return sorted(name for name, cls in _BACKENDS.items() if cls.supports(device))


def get_attention_backend(name: str | None, device: torch.device | str) -> type[AttentionBackend]:
    device = torch.device(device)
    if name is None:
        name = _DEFAULTS.get(device.type, _FALLBACK)
    cls = _BACKENDS.get(name)
    if cls is None or not cls.supports(device):
        why = "unknown attention backend" if cls is None else "attention backend not supported on this device:"
        valid = ", ".join(available_backends(device)) or "none"
        raise ValueError(f"{why} {name!r} ({device.type}); valid choices: {valid}")
    return cls
