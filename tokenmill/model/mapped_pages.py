"""Give back the pages of memory-mapped weight files that no parameter uses any more.

safetensors' `safe_open(framework="pt")` maps each file once (privately) and hands out tensors that are
views of the mapping; `assign` (layers/linear.py) makes a parameter of such a view without a copy. Every
page of the file that loading reads is then resident in this process (file-backed RSS) for as long as the
mapping lives, and it lives while any one tensor of the file does, a norm weight of a few KiB being enough.
With `--quantization int8|int4` the float weights are read once, packed and dropped, so those pages are
dead: `release(model)` unmaps them from the process (`madvise(MADV_DONTNEED)`; the kernel keeps them in
its page cache, and a later read of the file faults them back in from there) unless a live parameter or
buffer of the model still lies on them. The same goes for the parts that a fused layer (qkv, gate_up)
copied into its own tensor, and for tensors converted to another dtype at load.

Only ranges checked against /proc/self/maps to lie in a mapping of the weight file are ever released, and
only whole pages inside dead tensors: a page shared with a live tensor stays. Elsewhere (no /proc, no
madvise, a safetensors that copies instead of mapping) nothing is tracked and nothing changes.

`resident_bytes` and `process_memory` measure what is resident, for the start-up log (executor/worker.py).
"""
from __future__ import annotations

import bisect
import ctypes
import mmap
import os

import numpy as np
import torch
from torch import nn

_PAGE = mmap.PAGESIZE
# While loading: file pages given back after every RECLAIM_EVERY bytes of checkpoint tensors read, heap
# trimmed after every RECLAIM_EVERY bytes of float weights packed (each costs a scan: not per tensor).
RECLAIM_EVERY = 32 << 20
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)  # platforms vary
_libc = None


def _c_library():
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
        except (OSError, TypeError):  # TypeError: Windows has no process-wide handle
            _libc = False
    return _libc or None


def c_function(name: str, argtypes: list, restype=ctypes.c_int):
    """The C library's function `name` with its signature set, or None where the library or the symbol is missing."""
    libc = _c_library()
    fn = getattr(libc, name, None) if libc is not None else None  # getattr: libc symbols vary by platform and build
    if fn is not None:
        fn.argtypes, fn.restype = argtypes, restype
    return fn


def _file_mappings(path: str) -> list[tuple[int, int]]:
    """Address ranges at which `path` is mapped in this process ([] where /proc/self/maps is unreadable)."""
    real = os.path.realpath(path)
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n") == real:
                    start, end = (int(a, 16) for a in fields[0].split("-"))
                    ranges.append((start, end))
    except OSError:
        return []
    return ranges


def _storage_range(t: torch.Tensor) -> tuple[int, int] | None:
    if t.device.type != "cpu" or t.is_mkldnn:  # oneDNN-packed weights (onednn_pack.py): own memory, no mapping
        return None
    s = t.untyped_storage()
    n = s.nbytes()
    if n == 0:
        return None
    p = s.data_ptr()
    return p, p + n


def live_ranges(model: nn.Module) -> list[tuple[int, int]]:
    """Storage ranges of the model's parameters and buffers."""
    out = []
    for m in model.modules():
        for t in (*m._parameters.values(), *m._buffers.values()):
            r = _storage_range(t) if t is not None else None
            if r is not None:
                out.append(r)
    return out


class MappedPages:
    """The checkpoint tensors handed out as views of a file mapping, until their pages are released."""

    def __init__(self) -> None:
        self._maps: dict[str, list[tuple[int, int]]] = {}  # file -> its mappings, from /proc/self/maps
        self._pending: list[tuple[int, int, str]] = []  # tensor ranges not yet released, and their file
        self.released_bytes = 0
        self._since_release = 0

    def track(self, path: str, t: torch.Tensor) -> None:
        """Note `t` (read from `path`) if it is a view of a mapping of that file."""
        if _MADV_DONTNEED is None or _c_library() is None:
            return
        r = _storage_range(t)
        if r is None:
            return
        maps = self._maps.get(path)
        if maps is None:  # read once per file: safe_open mapped it before handing out any tensor
            maps = self._maps[path] = _file_mappings(path)
        if _inside(r, maps):
            self._pending.append((*r, path))
            self._since_release += r[1] - r[0]

    def due(self) -> bool:
        """Enough tracked since the last release that another is worth its scan of the model."""
        return self._since_release >= RECLAIM_EVERY

    def release(self, model: nn.Module) -> int:
        """madvise(MADV_DONTNEED) the whole pages of tracked tensors that no parameter or buffer of `model`
        overlaps; the others stay tracked (a float weight that is packed later). Returns bytes released."""
        self._since_release = 0
        if not self._pending:
            return 0
        live = sorted(live_ranges(model))
        starts = [s for s, _ in live]
        reach, m = [], 0  # reach[i]: the furthest end among live[0..i]
        for _, e in live:
            m = max(m, e)
            reach.append(m)
        dead, keep = [], []
        # A file is unmapped once no tensor views it; its addresses may then hold anything (an allocation, a
        # JIT's code): only ranges still inside a mapping of their file, re-read now, are ever released.
        mapped = {path: _file_mappings(path) for path in {p for _, _, p in self._pending}}
        for s, e, path in self._pending:
            if not _inside((s, e), mapped[path]):
                continue  # unmapped since it was tracked: nothing of ours is there any more
            i = bisect.bisect_left(starts, e)  # live ranges that start before this one ends
            if i and reach[i - 1] > s:
                keep.append((s, e, path))
            else:
                dead.append((s, e))
        self._pending = keep
        released = 0
        for s, e in _merge(dead):
            a, b = -(-s // _PAGE) * _PAGE, e // _PAGE * _PAGE  # whole pages only
            if b > a and _madvise(a, b - a):
                released += b - a
        self.released_bytes += released
        return released


def _inside(r: tuple[int, int], maps: list[tuple[int, int]]) -> bool:
    return any(a <= r[0] and r[1] <= b for a, b in maps)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Union of ranges that touch (tensors stored back to back share their boundary pages)."""
    out: list[list[int]] = []
    for s, e in sorted(ranges):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _madvise(addr: int, length: int) -> bool:
    fn = c_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
    return fn is not None and fn(addr, length, _MADV_DONTNEED) == 0


def trim_heap() -> None:
    """Hand freed heap memory back to the system (glibc's malloc_trim; elsewhere nothing): the float
    weights freed after packing must not stay counted in RSS as free-but-held heap."""
    trim = c_function("malloc_trim", [ctypes.c_size_t])  # glibc only
    if trim is not None:
        trim(0)


def resident_bytes(tensors) -> int | None:
    """Bytes of these CPU tensors' storages that are in memory now (mincore), whole pages inside each storage
    only: an allocation is not counted for the allocator's header sharing its first page. A pool that is never
    zeroed (the KV cache) costs RSS only for the pages written so far; this says how many. None where mincore
    is not available."""
    mincore = c_function("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p])
    if mincore is None:
        return None
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        r = _storage_range(t) if t is not None else None
        if r is None or r in seen:
            continue
        seen.add(r)
        a, b = -(-r[0] // _PAGE) * _PAGE, r[1] // _PAGE * _PAGE
        if b <= a:
            continue
        vec = (ctypes.c_ubyte * ((b - a) // _PAGE))()
        if mincore(a, b - a, vec) != 0:
            return None
        total += int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1)) * _PAGE
    return total


def process_memory() -> dict[str, int] | None:
    """This process's resident memory in bytes: "rss", "anonymous" and "file" (file-backed: shared libraries,
    mapped files; clean pages the kernel can drop and read back). None without /proc/self/smaps_rollup."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    except OSError:
        return None
    if "Rss" not in fields or "Anonymous" not in fields:
        return None
    return {"rss": fields["Rss"], "anonymous": fields["Anonymous"], "file": fields["Rss"] - fields["Anonymous"]}
