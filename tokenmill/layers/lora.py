"""The LoRA delta of a linear layer for a batch that mixes adapters (and the base model) in one forward.

Each adapted layer holds `max_loras` slots. A slot keeps one adapter's A of every shard of the layer stacked
([S * r, in], S = 1 for o/down, 2 for gate_up, 3 for qkv) and B ([out, R], its first r columns used), so the
step computes, per adapter present in the step (the Punica SGMV idea: grouped by adapter, not per token):

    u = x[rows] @ A_slot^T            shrink: one GEMM for all shards of the layer
    y[rows, shard s] += u_s @ B_s^T   expand: one GEMM per shard (its own r columns of u)

`rows` are the step's tokens of that adapter: a slice when they are contiguous (requests of one adapter next to
each other), else an index (gathered, scattered back with index_add_). A slot is sized to the adapter's own rank
(no padding to --max-lora-rank in the arithmetic). The runner sets `LoRAStep` before each forward; layers read it.

That is the portable path. On the CPU in float32 the native kernel (csrc/lora_delta.cpp) does the same for all
adapters of the step in one call per layer (a token's slot from `LoRAStep.native_slots`): the ranks are small, so
torch's per-adapter, per-shard dispatch, gather and scatter cost more than the arithmetic at decode. It works a
token at a time, so runs of at least GEMM_MIN_TOKENS tokens of one adapter (prompt chunks) keep the GEMMs, on
slices (measured crossover: ~64 tokens for SmolLM2's qkv and gate_up at rank 16, 2 threads; at 2048 tokens the
GEMMs are 2.5x faster, at 64 decode tokens of 4 adapters the kernel is 3.5x). TOKENMILL_LORA_NATIVE=0 keeps the
torch path for everything.
Under tensor parallelism each rank keeps its shard of B (column-parallel layers) or of A (row-parallel layers,
whose partial sums the layer's all-reduce adds up, delta included).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill import native

NATIVE_ENV = "TOKENMILL_LORA_NATIVE"
GEMM_MIN_TOKENS = 64  # a run of this many tokens of one adapter is cheaper as GEMMs than in the native kernel


def native_enabled() -> bool:
    return os.environ.get(NATIVE_ENV, "1") != "0" and native.has_op("lora_delta")


@dataclass
class LoRAStep:
    """This step's tokens by adapter slot: [(slot, rows)], rows a slice or a LongTensor of token indices."""

    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)
    # The native path: runs of >= GEMM_MIN_TOKENS tokens of one slot, done as GEMMs on slices, and every other
    # adapter token's slot (int32 [T], -1 for the base model and for the long runs' tokens) for the kernel.
    long_runs: list[tuple[int, slice]] = field(default_factory=list)
    native_slots: torch.Tensor | None = None
    native_tokens: int = 0

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def set(self, token_slots: list[tuple[int, int, int]], num_tokens: int, device: torch.device) -> None:
        """From the adapters' runs (slot, first token, end) in batch order, of a step of `num_tokens` tokens (the
        others run the base model): the native path's long runs and slot per token, and the torch path's one
        group per slot (a slice where its runs touch, else an index). Per run, not per token; numpy, not torch
        ops, for the small arrays."""
        slots = np.full(num_tokens, -1, dtype=np.int32)
        self.long_runs, self.native_tokens = [], 0
        spans: dict[int, list[list[int]]] = {}
        for slot, a, b in token_slots:
            if slot < 0 or b <= a:
                continue
            if b - a >= GEMM_MIN_TOKENS:
                self.long_runs.append((slot, slice(a, b)))
            else:
                slots[a:b] = slot
                self.native_tokens += b - a
            merged = spans.setdefault(slot, [])
            if merged and merged[-1][1] == a:
                merged[-1][1] = b
            else:
                merged.append([a, b])
        self.native_slots = torch.from_numpy(slots).to(device)
        self.groups = [
            (slot, slice(*m[0]) if len(m) == 1 else
             torch.from_numpy(np.concatenate([np.arange(a, b) for a, b in m])).to(device))
            for slot, m in spans.items()]


class LoRALayer:
    """The slots of one linear layer (its rank's shard) and the delta it adds to the layer's output."""

    def __init__(self, layer, step: LoRAStep, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.step = step
        self.sizes = list(layer.output_partition_sizes)  # this rank's rows of each shard
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        S, n_in, n_out = len(self.sizes), layer.input_size_per_partition, layer.output_size_per_partition
        self.a = torch.zeros(max_loras, S * max_rank, n_in, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, n_out, max_rank, dtype=dtype, device=device)
        self.ranks = [0] * max_loras  # per slot: the adapter's rank in this layer (0: it does not adapt it)
        self.ranks_t = torch.zeros(max_loras, dtype=torch.int64, device=device)  # the same, for the native kernel
        self.native = native_enabled() and torch.device(device).type == "cpu" and dtype == torch.float32

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes

    def set(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """One slot from per-shard (A [r_s, in], B [out_s, r_s]) already cut to this rank (None: shard not
        adapted). Shards of different ranks share the largest; the others' extra rows and columns stay zero."""
        r = max((a.shape[0] for p in parts if p is not None for a in p[:1]), default=0)
        self.a[slot].zero_()
        self.b[slot].zero_()
        for s, p in enumerate(parts):
            if p is None:
                continue
            a, b = p
            self.a[slot, s * r : s * r + a.shape[0]].copy_(a)
            self.b[slot, self.offsets[s] : self.offsets[s] + self.sizes[s], : b.shape[1]].copy_(b)
        self.ranks[slot] = r
        self.ranks_t[slot] = r

    def clear(self, slot: int) -> None:
        self.ranks[slot] = 0
        self.ranks_t[slot] = 0

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y += the adapters' deltas for their tokens of x (y is the layer's output, [T, out])."""
        if self.native and y.dtype == torch.float32 and y.stride(-1) == 1 and x.dtype == torch.float32:
            step = self.step
            for slot, rows in step.long_runs:
                self._gemm(x, y, slot, rows)
            if step.native_tokens:
                torch.ops.tokenmill.lora_delta(y, x.contiguous(), self.a, self.b, step.native_slots, self.ranks_t,
                                               self.sizes)
            return y
        return self.add_delta_torch(x, y)

    def _gemm(self, x: torch.Tensor, y: torch.Tensor, slot: int, rows: slice) -> None:
        """One adapter's tokens [rows] (contiguous): a shrink GEMM and an expand GEMM per shard, in place."""
        r = self.ranks[slot]
        if r == 0:
            return
        S = len(self.sizes)
        u = torch.mm(x[rows], self.a[slot, : S * r].t())  # [n, S * r]
        for s in range(S):
            o, n = self.offsets[s], self.sizes[s]
            y[rows, o : o + n].addmm_(u[:, s * r : (s + 1) * r], self.b[slot, o : o + n, :r].t())

    def add_delta_torch(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The portable path: per adapter of the step, one shrink GEMM and one expand GEMM per shard."""
        for slot, rows in self.step.groups:
            if isinstance(rows, slice):
                self._gemm(x, y, slot, rows)
                continue
            r, S = self.ranks[slot], len(self.sizes)
            if r == 0:
                continue
            u = torch.mm(x[rows], self.a[slot, : S * r].t())  # [n, S * r]: gathered rows
            delta = torch.empty(u.shape[0], y.shape[1], dtype=y.dtype, device=y.device)
            for s in range(S):
                o, n = self.offsets[s], self.sizes[s]
                delta[:, o : o + n] = torch.mm(u[:, s * r : (s + 1) * r], self.b[slot, o : o + n, :r].t())
            y.index_add_(0, rows, delta)
        return y
