"""What this machine computes fast. On CPUs without native bf16/fp16 math (e.g. AVX2-only),
half-precision GEMMs run ~80x slower than fp32, so compute in fp32 and keep low precision for storage."""
from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_supports(dtype: torch.dtype) -> bool:
    flags = cpu_flags()
    if dtype == torch.bfloat16:
        return bool({"avx512_bf16", "amx_bf16"} & flags)
    if dtype == torch.float16:
        return bool({"avx512_fp16", "amx_fp16"} & flags)
    return True


def parse_dtype(name: str | torch.dtype) -> torch.dtype | None:
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return None
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {name!r}.")
    return _DTYPES[name]


def choose_dtypes(requested: str | torch.dtype, model_dtype: torch.dtype, device: str) -> tuple[torch.dtype, torch.dtype]:
    """(storage dtype, compute dtype)."""
    want = parse_dtype(requested)
    if not str(device).startswith("cpu"):
        d = want or model_dtype
        return d, d
    if want is None:
        # auto on CPU: fp32 unless the CPU does this half type natively.
        d = model_dtype if model_dtype != torch.float32 and cpu_supports(model_dtype) else torch.float32
        return d, d
    if cpu_supports(want):
        return want, want
    if want != torch.float32:
        log.info("CPU lacks native %s math: storing weights in %s, computing in float32", want, want)
    return want, torch.float32
