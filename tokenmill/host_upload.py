"""A step's host arrays onto the device without blocking the host.

A copy from pageable host memory to a GPU blocks the host until the driver has staged it: every step's inputs,
metadata and sampling parameters would each cost a stall. From pinned (page-locked) memory the copy is
asynchronous. `Uploader` keeps a small ring of pinned buffers, reused step after step (pinning is slow, so
never per step), and copies each array with `non_blocking=True` into a fresh device tensor (the caching
allocator's: no sync, and a step's tensors outlive the next upload, as pipeline micro-batches need). A buffer
is rewritten only after its previous copy has run (an event per buffer; in practice long done, since each step
ends with the copy of its sampled tokens to the host).

On the CPU there is nothing to copy: the array is handed over as a tensor sharing its memory, as before.
"""
from __future__ import annotations

import numpy as np
import torch

RING = 8  # pinned buffers in turn: a step uploads a few arrays (inputs, attention metadata, sampling tensors)
MIN_BYTES = 1 << 16


def _pinned_empty(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _event():
    return torch.cuda.Event()


class Uploader:
    def __init__(self, device: torch.device | str, staging: bool | None = None) -> None:
        self.device = torch.device(device)
        # Staging through pinned buffers: on CUDA (tests force it on the CPU with stand-ins for pinning and events).
        self.staging = self.device.type == "cuda" if staging is None else staging
        self._host: list[torch.Tensor | None] = [None] * RING
        self._copied: list = [None] * RING  # per buffer: the event after its last copy out
        self._next = 0

    def upload(self, array: np.ndarray | torch.Tensor) -> torch.Tensor:
        """`array` (host) as a tensor on the device, same dtype and shape."""
        src = torch.from_numpy(np.ascontiguousarray(array)) if isinstance(array, np.ndarray) else array.contiguous()
        if self.device.type == "cpu" and not self.staging:
            return src
        if not self.staging:  # another device without pinned memory: a plain copy
            return src.to(self.device)
        i = self._next
        self._next = (i + 1) % RING
        nbytes = src.numel() * src.element_size()
        buf = self._host[i]
        if buf is None or buf.numel() < nbytes:  # grown by doubling; the old one is freed once its copy has run
            buf = self._host[i] = _pinned_empty(max(nbytes, 2 * (buf.numel() if buf is not None else 0), MIN_BYTES))
        elif self._copied[i] is not None:
            self._copied[i].synchronize()
        staged = buf[:nbytes].view(src.dtype).view(src.shape)
        staged.copy_(src)
        out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        out.copy_(staged, non_blocking=True)
        event = self._copied[i] = self._copied[i] or _event()
        event.record()
        return out
