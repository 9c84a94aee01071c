"""Large CPU weights moved into transparent huge pages, once, at load.

A batch-1 decode streams every weight byte once per token. With 4 KiB pages that stream crosses a page (and
its TLB entry) every 4 KiB; in 2 MiB pages, every 2 MiB. Measured on a 2-vCPU Intel Xeon (Linux 6.18, THP in
`madvise` mode as most distributions ship it): SmolLM2-1.7B shapes at Q4_0 decode 15.7 -> 17.9 tok/s
(docs/performance.md). torch's allocator asks for huge pages only under THP_MEM_ALLOC_ENABLE=1, read once for
the whole process; here only the weights that a decode streams move, into their own anonymous mappings.

The mapping has 2 MiB of slack so the tensor can start on a 2 MiB boundary; only the whole 2 MiB spans of the
tensor are advised (the slack and the tensor's tail keep small pages and are never touched beyond the tail), so
no memory is wasted. TOKENMILL_HUGE_PAGES=0 keeps the allocator's pages.
"""
from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import torch

HUGE = 2 << 20
MIN_BYTES = 2 * HUGE  # smaller tensors hold at most one whole huge page: not worth a mapping of their own
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
    # Private: a shared anonymous mapping is shmem, whose huge pages follow shmem_enabled (usually never).
    region = mmap.mmap(-1, n + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = torch.frombuffer(region, dtype=torch.uint8)  # the tensor keeps the mapping alive
    offset = (-buf.data_ptr()) % HUGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, offset, n // HUGE * HUGE)
    except OSError:  # (a kernel without THP support for anonymous memory): small pages, still correct
        pass
    out = buf[offset:offset + n].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
