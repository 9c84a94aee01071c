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


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def tune_malloc() -> bool:
    """Keep freed activation memory in the process instead of handing it back to the kernel each step.

    torch's CPU allocator takes every activation from malloc. With glibc's adaptive thresholds, a step's
    large tensors can come fresh from mmap and be returned on free, so every step page-faults them in
    again (measured: 5.3 M minor faults, 12 s of system time in a 63 s serving run of the engine core
    process). Fixed thresholds (mmap only above 32 MiB, glibc's maximum; trim only above 4 GiB free) keep that
    memory for the next step, as jemalloc/tcmalloc would. Called in processes tokenmill owns (`tokenmill
    serve`, the engine core, workers), not by the `LLM` library. TOKENMILL_MALLOC_TUNING=0 turns it off. Returns whether it was applied."""
    import ctypes
    import ctypes.util
    import os

    if os.environ.get("TOKENMILL_MALLOC_TUNING", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 32 << 20) and mallopt(_M_TRIM_THRESHOLD, 4 << 30) and mallopt(_M_TOP_PAD, 64 << 20)
    log.debug("malloc thresholds %s", "fixed" if ok else "unchanged")
    return bool(ok)


def exit_without_teardown(code: int) -> None:
    """End a process tokenmill owns (`tokenmill serve`, the engine core) once it has closed what it opened.

    The interpreter's own teardown collects the module graphs of torch, transformers and their imports: measured
    2.4 s in the server and ~1 s in the engine core after a clean stop on a quiet 2-core VM, past 10 s on a
    loaded one, where `systemctl stop` and `docker stop` count it against their deadline before they kill.
    Nothing is left for it to do by then (the engine is joined, the usage database closed), so flush what is
    buffered and leave."""
    import os
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing to keep
            pass
    os._exit(code)
