"""Loads tokenmill's native CPU kernels (tokenmill/csrc, built by `pip install` / `make` as `tokenmill._C_<tier>`,
one build per instruction-set tier: tokenmill/isa.py). Absent or broken kernels are not an error: `available()`
says False, one log line says why, and callers fall back to pure torch. TOKENMILL_NO_NATIVE=1 forces the fallback."""
from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

from tokenmill import isa

log = logging.getLogger(__name__)


def built_tiers() -> list[str]:
    """The instruction-set tiers whose build is installed (tokenmill/_C_<tier>*.so), best first."""
    names = [t.name for t in isa.TIERS] + [isa.NATIVE]
    return [n for n in names if _spec(n) is not None]


def _spec(tier: str):
    try:
        spec = importlib.util.find_spec(f"tokenmill._C_{tier}")
    except (ImportError, ValueError):
        return None
    return spec if spec is not None and spec.origin else None


@functools.cache
def load() -> str | None:
    """Loads the kernels once: the best tier built that this CPU runs (tokenmill/isa.py; TOKENMILL_ISA names
    another). Returns None when loaded, else the reason they are not."""
    global _tier
    if os.environ.get("TOKENMILL_NO_NATIVE") == "1":
        return "TOKENMILL_NO_NATIVE=1"
    built = built_tiers()
    if not built:
        return "tokenmill._C_* was not built (no C++ compiler at install time?); rebuild with `make native`"
    tier, why = isa.pick(built, isa.cpu_flags(), isa.forced())
    if tier is None:
        return why
    try:
        torch.ops.load_library(_spec(tier).origin)
        torch.ops.tokenmill.paged_attention  # noqa: B018 - the op must be registered
    except (OSError, RuntimeError, AttributeError) as e:
        return f"tokenmill._C_{tier} does not load ({e}); rebuild with `make native`"
    _tier = tier
    log.debug("native kernels: %s (%s)", tier, why)
    return None


_tier: str | None = None


def tier() -> str | None:
    """The instruction-set tier loaded (avx512_vnni, avx512, avx2_vnni, avx2, native), or None."""
    return _tier if available() else None


def available() -> bool:
    return load() is None


def library_path() -> str | None:
    """The file of the loaded tier's build (kernels_id hashes it: caches of measured choices hold per build)."""
    return _spec(_tier).origin if available() and _tier is not None else None


@functools.cache
def has_op(name: str) -> bool:
    """The kernels are loaded and define torch.ops.tokenmill.<name> (an older build may lack newer ops)."""
    return available() and hasattr(torch.ops.tokenmill, name)


def int8_dot_path() -> str | None:
    """The integer dot product of the int8-activation kernels: avx512-vnni, avx-vnni, avx2 or none (None: no kernels)."""
    return torch.ops.tokenmill.int8_dot_path() if has_op("int8_dot_path") else None


def cpu_capability() -> str | None:
    """The vector instruction set the kernels were compiled for (AVX2, AVX512, DEFAULT), or None."""
    return torch.ops.tokenmill.cpu_capability() if available() else None
