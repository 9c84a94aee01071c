"""Attention backends by name; the device picks the default, `--attention-backend` overrides it."""
from __future__ import annotations

import logging

import torch

from tokenmill.layers.attention_backends.base import AttentionBackend

_BACKENDS: dict[str, type[AttentionBackend]] = {}
# Preferred first; the first one the device supports is the default.
_DEFAULTS: dict[str, tuple[str, ...]] = {"cpu": ("cpu_paged", "torch_sdpa"), "cuda": ("triton_paged", "torch_sdpa")}
_FALLBACK = "torch_sdpa"  # runs on any device torch does
log = logging.getLogger(__name__)
_warned: set[str] = set()


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
        name = default_backend(device)
    cls = _BACKENDS.get(name)
    if cls is None or not cls.supports(device):
        why = "unknown attention backend" if cls is None else "attention backend not supported on this device:"
        valid = ", ".join(available_backends(device)) or "none"
        raise ValueError(f"{why} {name!r} ({device.type}); valid choices: {valid}")
    return cls


def default_backend(device: torch.device | str) -> str:
    device = torch.device(device)
    for name in _DEFAULTS.get(device.type, (_FALLBACK,)):
        cls = _BACKENDS.get(name)
        why = "not registered" if cls is None else cls.unavailable_reason(device)
        if why is None:
            return name
        if name not in _warned:
            _warned.add(name)
            log.warning("attention backend %s is not available on %s (%s); falling back", name, device.type, why)
    return _FALLBACK
