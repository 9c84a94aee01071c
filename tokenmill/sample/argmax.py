"""The greedy token of each row, without torch's CPU argmax.

torch's CPU argmax carries an index beside each value and runs scalar: over SmolLM2's 49,152-token vocabulary it
took 7.2 ms for 64 rows on one thread of a Xeon VM (and 13-16 ms on two, where the threads wait on each other),
while `amax`, a plain vectorised reduction, took 0.5 ms (docs/performance.md).

float32 rows on the CPU go to the native kernel (csrc/row_argmax.cpp: a vectorised pass for the maximum, one for
its first column). Otherwise (bf16 rows, no native build) `chunked_argmax`: the maximum of each chunk of CHUNK
logits (vectorised), the first chunk holding the row's maximum (a small argmax), then the first maximum inside
that chunk (an argmax over CHUNK values a row). Both give argmax's index in every case, ties (the first) and NaN
(the first NaN) included. GPUs keep torch's argmax.
"""
from __future__ import annotations

import torch
from torch import Tensor

from tokenmill import native

CHUNK = 1024


def row_argmax(x: Tensor) -> Tensor:
    """x.argmax(dim=-1) for a 2-D tensor [rows, vocab]."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[1] > 0 and native.has_op("row_argmax"):
        return torch.ops.tokenmill.row_argmax(x)
    return chunked_argmax(x)


def chunked_argmax(x: Tensor) -> Tensor:
    """row_argmax in torch ops (the fallback)."""
    rows, width = x.shape
    n = width // CHUNK
    if x.device.type != "cpu" or n < 4 or rows == 0:
        return x.argmax(dim=-1)
    x = x.contiguous()
    best = x[:, : n * CHUNK].view(rows, n, CHUNK).amax(dim=-1)
    if width > n * CHUNK:  # the tail: one more, shorter chunk
        best = torch.cat([best, x[:, n * CHUNK:].amax(dim=-1, keepdim=True)], dim=1)
    start = best.argmax(dim=-1) * CHUNK
    # The chosen chunk's columns; a short tail chunk repeats the last column, after the real ones, so the
    # first maximum is still the real one.
    cols = (start.unsqueeze(1) + torch.arange(CHUNK, device=x.device)).clamp_(max=width - 1)
    return start + x.gather(1, cols).argmax(dim=-1)
