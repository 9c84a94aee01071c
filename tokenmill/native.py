"""Loads tokenmill's native CPU kernels (tokenmill/csrc, built by `pip install` / `make` as
`tokenmill._C`). Absent or broken kernels are not an error: `available()` says False, one log line
says why, and callers fall back to pure torch. TOKENMILL_NO_NATIVE=1 forces the fallback."""
from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

log = logging.getLogger(__name__)


@functools.cache
def load() -> str | None:
    """Loads the kernels once; returns None when loaded, else the reason they are not."""
    if os.environ.get("TOKENMILL_NO_NATIVE") == "1":
        return "TOKENMILL_NO_NATIVE=1"
    try:
        spec = importlib.util.find_spec("tokenmill._C")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return "tokenmill._C was not built (no C++ compiler at install time?); rebuild with `make native`"
    try:
        torch.ops.load_library(spec.origin)
        torch.ops.tokenmill.paged_attention  # noqa: B018 - the op must be registered
    except (OSError, RuntimeError, AttributeError) as e:
        return f"tokenmill._C does not load ({e}); rebuild with `make native`"
    return None


def available() -> bool:
    return load() is None


@functools.cache
def has_op(name: str) -> bool:
    """The kernels are loaded and define torch.ops.tokenmill.<name> (an older build may lack newer ops)."""
    return available() and hasattr(torch.ops.tokenmill, name)


def int8_dot_path() -> str | None:
    """The integer dot product of the int8-activation kernels: avx512-vnni, avx2 or none (None: no kernels)."""
    return torch.ops.tokenmill.int8_dot_path() if has_op("int8_dot_path") else None


def cpu_capability() -> str | None:
    """The vector instruction set the kernels were compiled for (AVX2, AVX512, DEFAULT), or None."""
    return torch.ops.tokenmill.cpu_capability() if available() else None
