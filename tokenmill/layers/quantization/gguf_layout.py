"""Which row layout a GGUF weight runs in on this CPU: interleaved rows (R16) or split rows, chosen by measuring.

R16 (csrc/gguf_r16.h) puts one row in each AVX-512 lane; split rows widen each row's blocks into vectors of its
own. Which is faster depends on the CPU (how it runs 512-bit permutes and vpdpbusd: AMD Zen 4 splits 512-bit
operations in two halves, Intel runs them whole) and on the shape (short rows pay the split kernel's per-row
work). So the loader does not assume: for each (type, rows, columns, activation mode) it times one decode-sized
product of both layouts on a sample of the weight's shape, alternating, and keeps the faster (R16 on a tie). The
choice is cached in $TOKENMILL_CACHE/kernels.json (default ~/.cache/tokenmill), keyed by the CPU model, the thread
count and the kernels' build (a rebuilt extension measures again), so later starts read it back.

TOKENMILL_GGUF_INTERLEAVE: auto (the default: measure), 1 (always R16 where the kernels are built), 0 (never).
"""
from __future__ import annotations

import functools
import hashlib
import os
import time
from pathlib import Path

import numpy as np
import torch

from tokenmill.diagnostics.calibration import cache_dir, cache_lock, cpu_name, read_cache, store_entry

LAYOUT_VERSION = 1
SAMPLE_BYTES = 4 << 20  # the rows timed: at most this many bytes of the weight's shape
ROUNDS = 5  # alternating rounds of both layouts; each layout's best round counts


@functools.lru_cache(maxsize=1)
def kernels_id() -> str:
    """A short hash of the loaded native extension's file: the cache's entries hold for this build only."""
    from tokenmill import native

    path = native.library_path()
    if path is None:
        return "none"
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def cache_file() -> Path:
    return cache_dir() / "kernels.json"


def key(qtype: int, rows: int, cols: int, int8_activations: bool) -> str:
    mode = "int8" if int8_activations else "float"
    return (f"v{LAYOUT_VERSION}|gguf-layout|{cpu_name()}|{torch.get_num_threads()}|{kernels_id()}|"
            f"{qtype}|{rows}x{cols}|{mode}")


def _sample(qtype: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks of the weight's shape (rows capped to SAMPLE_BYTES, a multiple of 16) in both layouts."""
    import gguf

    from tokenmill.layers.quantization.gguf import R16_ROWS, interleave_rows, row_bytes, split_rows

    n = max(R16_ROWS, min(rows, SAMPLE_BYTES // row_bytes(qtype, cols)) // R16_ROWS * R16_ROWS)
    w = np.random.default_rng(0).standard_normal((n, cols)).astype(np.float32)
    blocks = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype)))
    split = split_rows(blocks, qtype)
    return split, interleave_rows(split, qtype)


def measure(qtype: int, rows: int, cols: int, int8_activations: bool) -> dict:
    """Seconds per decode-sized product (one row of x) of each layout: {"split": s, "r16": s}."""
    from tokenmill.layers.quantization.gguf import R16, SPLIT

    split, r16 = _sample(qtype, rows, cols)
    x = torch.randn(1, cols)
    forms = {"split": (split, SPLIT + qtype), "r16": (r16, R16 + qtype)}
    calls = max(3, min(200, int(2e7 // split.numel())))  # ~20 MB of weights per round and layout, <= 200 calls
    best = {name: float("inf") for name in forms}
    for _ in range(ROUNDS):
        for name, (w, qt) in forms.items():
            torch.ops.tokenmill.gguf_linear(x, w, qt, cols, None, int8_activations)  # warm
            t = time.perf_counter()
            for _ in range(calls):
                torch.ops.tokenmill.gguf_linear(x, w, qt, cols, None, int8_activations)
            best[name] = min(best[name], (time.perf_counter() - t) / calls)
    return best


@functools.lru_cache(maxsize=None)
def choose_r16(qtype: int, rows: int, cols: int, int8_activations: bool) -> bool:
    """Whether R16 measured at least as fast as split rows for this weight on this CPU (cached)."""
    f, k = cache_file(), key(qtype, rows, cols, int8_activations)
    entry = read_cache(f).get(k)
    if not (isinstance(entry, dict) and entry.get("layout") in ("r16", "split")):
        with cache_lock(f):
            entry = read_cache(f).get(k)  # another process may have measured meanwhile
            if not (isinstance(entry, dict) and entry.get("layout") in ("r16", "split")):
                seconds = measure(qtype, rows, cols, int8_activations)
                entry = {"layout": "r16" if seconds["r16"] <= seconds["split"] else "split",
                         "seconds": seconds, "measured_at": time.time()}
                store_entry(f, k, entry)
    return entry["layout"] == "r16"


def interleave_setting() -> str:
    value = os.environ.get("TOKENMILL_GGUF_INTERLEAVE", "auto")
    if value not in ("auto", "0", "1"):
        raise ValueError(f"TOKENMILL_GGUF_INTERLEAVE must be auto, 0 or 1; got {value!r}")
    return value
