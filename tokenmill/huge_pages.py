"""Large CPU weights moved into transparent huge pages, once, at load.

A batch-1 decode streams every weight byte once per token. With 4 KiB pages that stream crosses a page (and
its TLB entry) every 4 KiB; in 2 MiB pages, every 2 MiB. Measured on a 2-vCPU Intel Xeon (Linux 6.18, THP in
`madvise` mode as most distributions ship it): SmolLM2-1.7B shapes at Q4_0 decode 15.7 -> 17.9 tok/s
(docs/performance.md). torch's allocator asks for huge pages only under THP_MEM_ALLOC_ENABLE=1, read once for
the whole process; here only the weights that a decode streams move, into their own anonymous mappings.

A tensor of ARENA_BYTES / 2 or more gets a mapping of its own, with 2 MiB of slack so it can start on a 2 MiB
boundary; only its whole 2 MiB spans are advised (the slack and the tail keep small pages and are never touched
beyond the tail), so no memory is wasted. Smaller ones (down to MIN_BYTES) are placed one after the other, in
load order, into shared mappings of ARENA_BYTES (the arena): a 2.4 MiB attention projection alone would hold one
whole huge page and a 0.2 MiB one none, and such matrices were the slowest GEMVs of a 1.7B decode (0.5-0.6 of
the read bandwidth, against 0.8 for the large ones in huge pages). In the arena a layer's small matrices also sit
next to each other, as the decode reads them. At most the last 2 MiB page of an arena is partly used.
TOKENMILL_HUGE_PAGES=0 keeps the allocator's pages.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import sys
import threading
from pathlib import Path
from typing import Iterator

import torch

HUGE = 2 << 20
MIN_BYTES = 4096  # below a page there is nothing to gain
ARENA_BYTES = 64 << 20  # one shared mapping for the smaller tensors; from half of it a tensor gets its own
ALIGN = 64  # a tensor's start in the arena: a cache line
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Linux with transparent huge pages not set to `never`, and not turned off by TOKENMILL_HUGE_PAGES=0."""
    if os.environ.get("TOKENMILL_HUGE_PAGES", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_MODE.read_text()
    except OSError:
        return False


def to_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """The same values in a 2 MiB-aligned anonymous mapping advised MADV_HUGEPAGE (a new tensor), or `t`
    itself where that does not apply (not a large contiguous CPU tensor, or huge pages unavailable)."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.nbytes < MIN_BYTES or not available():
        return t
    n = t.nbytes
    if _SEPARATE.active and n < 2 * HUGE:
        return t
    out = _ARENA.place(n) if n < ARENA_BYTES // 2 and not _SEPARATE.active else _mapping(n)
    out = out.view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def _mapping(n: int) -> torch.Tensor:
    """n bytes starting on a 2 MiB boundary of a new private anonymous mapping, its whole 2 MiB spans advised."""
    # Private: a shared anonymous mapping is shmem, whose huge pages follow shmem_enabled (usually never).
    region = mmap.mmap(-1, n + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = torch.frombuffer(region, dtype=torch.uint8)  # every view of buf keeps the mapping alive
    offset = (-buf.data_ptr()) % HUGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, offset, n // HUGE * HUGE)
    except OSError:  # (a kernel without THP support for anonymous memory): small pages, still correct
        pass
    return buf[offset:offset + n]


class _Arena:
    """Smaller tensors placed one after another in shared huge-page mappings of ARENA_BYTES: a new mapping when
    the next tensor does not fit the current one. A mapping lives while any tensor placed in it does."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # loads of two models in one process (threads of a server reload)
        self.buf: torch.Tensor | None = None
        self.used = 0

    def place(self, n: int) -> torch.Tensor:
        with self.lock:
            start = -(-self.used // ALIGN) * ALIGN
            if self.buf is None or start + n > self.buf.numel():
                self.buf, start = _mapping(ARENA_BYTES), 0
            self.used = start + n
            return self.buf[start:start + n]


    def end(self) -> None:
        with self.lock:
            self.buf, self.used = None, 0


_ARENA = _Arena()


class _Separate(threading.local):
    active = False


_SEPARATE = _Separate()


@contextlib.contextmanager
def separate_mappings() -> Iterator[None]:
    """Loads inside keep no arena: a tensor holding two or more huge pages gets a mapping of its own, smaller ones
    stay where they are. For a model some of whose layers are then replaced by views of a file (weights streamed
    from disk, model/weight_store.py): a replaced tensor's own mapping goes with it, where an arena would have
    kept its pages for the sake of its resident neighbours."""
    _SEPARATE.active = True
    try:
        yield
    finally:
        _SEPARATE.active = False


def end_arena() -> None:
    """Placing is done (a model's load ends here): the arena lets go of its current mapping, which then lives
    exactly as long as the tensors placed in it, and the next tensor starts a new one. (A load that fails before
    this leaves its mapping to the next load, which fills the rest of it.)"""
    _ARENA.end()
