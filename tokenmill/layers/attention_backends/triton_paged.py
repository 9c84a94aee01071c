"""Paged attention in Triton (`triton_paged`): the CUDA default, and on the CPU under TRITON_INTERPRET=1 (where it
is tested against the float64 reference of the conformance suite and runs a tiny model end to end).

Same cache layout as torch_sdpa and cpu_paged ([num_blocks, block_size, Hk, D], int8's per-slot scales beside),
so KV transfer, prefix caching and the quantized formats work unchanged. Per layer: the step's K/V is written
into its slots (index_copy_ for float caches, kv_quant's reference quantizer for int8 / fp8), then one kernel
launch (triton_kernel.py) attends every request's queries, decodes and prompt chunks alike, over its keys read
through the block table: no gather, no padding to the longest request, no boolean mask, no device sync.
The launch's tiles (BLOCK_M query rows of one request each) are laid out on the CPU when the step's metadata is
built, once for all layers. Rows of requests verifying draft trees are attended again in torch with the tree
mask (torch_sdpa's group), as cpu_paged does.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.host_upload import Uploader
from tokenmill.layers.attention_backends import kv_quant
from tokenmill.layers.attention_backends.base import AttentionBackend, BatchLayout
from tokenmill.layers.attention_backends.registry import register_backend
from tokenmill.layers.attention_backends.torch_sdpa import SDPAGroup, attend_group, tree_group

if TYPE_CHECKING:
    from tokenmill.layers.attention import Attention

CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, kv_quant.FP8)
BLOCK_M = 16  # query rows per program (tl.dot needs 16 or more)
BLOCK_N = 32  # key positions per inner step


def _triton_missing() -> str | None:
    # Found, not imported: Triton decides at import whether its language runs compiled or interpreted
    # (TRITON_INTERPRET), so nothing here may import it before a kernel is first launched.
    return "triton is not installed" if importlib.util.find_spec("triton") is None else None


@dataclass
class TritonMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    block_table: torch.Tensor  # [B, max_blocks] int32
    query_start: torch.Tensor  # [B] int32
    query_len: torch.Tensor  # [B] int32
    kv_len: torch.Tensor  # [B] int32
    tile_req: torch.Tensor  # [tiles] int32: the request of each program's BLOCK_M query rows
    tile_first: torch.Tensor  # [tiles] int32: its first row, counted within the request
    tree_group: SDPAGroup | None = None


class TritonGraphBuffers:
    """The metadata of steps replayed from CUDA graphs (executor/cuda_graphs.py), in tensors whose addresses never
    change: a graph replays its kernels on the pointers it was captured with, so each step copies its values in
    (`fill`) instead of building new tensors. A graph takes a uniform batch: every request q new tokens (q = 1:
    decodes; q = k + 1: chain verifications of k drafts), q <= BLOCK_M, so the launch's layout is constant (one
    tile per request, request i's queries at rows i*q ..). Batches are padded to a captured size P; a pad request
    computes q tokens in the pad block (a block past the scheduler's pool): it writes its K/V there and attends to
    those slots only, so it can neither touch a request's blocks nor read garbage."""

    def __init__(self, max_batch: int, max_blocks: int, pad_block: int, block_size: int, device: torch.device,
                 max_query_len: int = 1) -> None:
        if max_query_len > BLOCK_M:
            raise ValueError(f"graphs take at most {BLOCK_M} queries per request, not {max_query_len}")
        i32, dev = torch.int32, torch.device(device)
        self.max_batch, self.max_blocks, self.max_query_len = max_batch, max_blocks, max_query_len
        self.block_size, self.pad_block = block_size, pad_block
        T = max_batch * max_query_len
        self.slot_mapping = torch.full((T,), pad_block * block_size, dtype=torch.long, device=dev)
        self.block_table = torch.full((max_batch, max_blocks), pad_block, dtype=i32, device=dev)
        self.kv_len = torch.ones(max_batch, dtype=i32, device=dev)
        self.requests = torch.arange(max_batch, dtype=i32, device=dev)  # each tile's request
        self.tile_first = torch.zeros(max_batch, dtype=i32, device=dev)
        self._starts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # q -> (query_start, query_len), fixed
        # One host-to-device copy per step: [slots P*q | kv_len P | block table P x n] packed on the host (pinned
        # on CUDA, so the copy does not block), then spread into the fixed buffers on the device.
        n = T + max_batch * (1 + max_blocks)
        self._host = torch.empty(n, dtype=torch.long, pin_memory=dev.type == "cuda")
        self._stage = torch.empty(n, dtype=torch.long, device=dev)
        self._copied = torch.cuda.Event() if dev.type == "cuda" else None  # the last copy out of _host has run

    def view(self, size: int, q: int = 1) -> TritonMetadata:
        """The metadata a graph of `size` requests of q tokens each is captured with (views of fixed buffers)."""
        if q not in self._starts:
            dev = self.requests.device
            self._starts[q] = (self.requests * q, torch.full((self.max_batch,), q, dtype=torch.int32, device=dev))
        starts, lens = self._starts[q]
        rows = self.requests[:size]
        return TritonMetadata(slot_mapping=self.slot_mapping[: size * q], block_table=self.block_table[:size],
                              query_start=starts[:size], query_len=lens[:size], kv_len=self.kv_len[:size],
                              tile_req=rows, tile_first=self.tile_first[:size])

    def fill(self, layout: BatchLayout, size: int) -> None:
        """This step's B requests into the buffers' first B rows, pad requests up to `size`. The pinned host
        buffer is rewritten only after the previous step's copy from it has run (an event; in practice long
        done: every such step ends with the copy of its sampled tokens to the host, ordered after it)."""
        B, n, q = layout.query_len.numel(), layout.block_table.shape[1], layout.max_query_len
        if (B > size or size > self.max_batch or n > self.max_blocks or q > self.max_query_len
                or layout.num_tokens != B * q):
            raise ValueError(f"a graph of {size} requests cannot take this step ({B} requests, {layout.num_tokens} "
                             f"tokens, {q} at most each, {n} blocks)")
        if self._copied is not None:
            self._copied.synchronize()
        h, T = self._host, size * q
        h[: B * q] = layout.slot_mapping
        pad = torch.arange(q) % self.block_size + self.pad_block * self.block_size  # a pad request's slots
        h[B * q : T] = pad.repeat(size - B)
        h[T : T + B] = layout.kv_len
        h[T + B : T + size] = q
        table = h[T + size : T + size + size * n].view(size, n)
        table[:B] = layout.block_table
        table[B:] = self.pad_block
        used = T + size + size * n
        stage = self._stage[:used]
        stage.copy_(h[:used], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self.slot_mapping[:T].copy_(stage[:T])
        self.kv_len[:size].copy_(stage[T : T + size])
        self.block_table[:size, :n].copy_(stage[T + size :].view(size, n))


@register_backend
class TritonPagedBackend(AttentionBackend):
    name = "triton_paged"
    supports_sinks = True

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        return cls.unavailable_reason(device) is None

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        missing = _triton_missing()
        if missing is not None:
            return missing
        kind = torch.device(device).type
        if kind == "cuda":
            return None
        if kind == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
            return None
        return "CUDA only (on the CPU: under TRITON_INTERPRET=1, for tests)"

    def kv_cache_shape(self, num_blocks: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, num_kv_heads, head_dim)

    def allocate_kv_cache(self, layers: list[Attention], num_blocks: int, dtype: torch.dtype) -> None:
        self.check_layers(layers, dtype)
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"triton_paged attention keeps its KV cache in float32, bfloat16 or float16 (or "
                             f"quantized: int8, float8_e4m3fn), not {dtype}")
        for a in layers:
            # Never zeroed: the kernel loads only keys below each request's kv_len.
            kv_quant.allocate(a, self.kv_cache_shape(num_blocks, a.num_kv_heads, a.head_dim), dtype, self.device)
            a.backend = self

    def __init__(self, block_size: int, device: torch.device) -> None:
        super().__init__(block_size, device)
        self.uploader = Uploader(self.device)

    def graph_buffers(self, max_batch: int, max_blocks: int, pad_block: int,
                      max_query_len: int = 1) -> TritonGraphBuffers | None:
        """Fixed-address metadata for steps replayed from CUDA graphs (executor/cuda_graphs.py)."""
        if max_query_len > BLOCK_M:
            return None
        return TritonGraphBuffers(max_batch, max_blocks, pad_block, self.block_size, self.device, max_query_len)

    def build_metadata(self, layout: BatchLayout) -> TritonMetadata:
        """The step's metadata in two copies to the device (the int32 tensors packed in one, the int64 slots)."""
        i32 = torch.int32
        q_len = layout.query_len.to("cpu", torch.long)
        B = q_len.numel()
        tiles = (q_len + BLOCK_M - 1) // BLOCK_M
        tile_req = torch.repeat_interleave(torch.arange(B), tiles)
        tile_first = (torch.arange(int(tiles.sum())) - torch.repeat_interleave(torch.cumsum(tiles, 0) - tiles, tiles))
        table = layout.block_table.to("cpu", i32)
        parts = [table.reshape(-1), layout.query_start, q_len, layout.kv_len, tile_req, tile_first * BLOCK_M]
        packed = self.uploader.upload(torch.cat([t.to("cpu", i32) for t in parts]))
        sizes = [t.numel() for t in parts]
        flat, q_start, q_len_d, kv_len, req, first = packed.split(sizes)
        return TritonMetadata(
            slot_mapping=self.uploader.upload(layout.slot_mapping.to("cpu", torch.long)),
            block_table=flat.view(table.shape), query_start=q_start, query_len=q_len_d, kv_len=kv_len,
            tile_req=req, tile_first=first, tree_group=tree_group(layout, self.block_size, self.device))

    def forward(self, layer: Attention, q, k, v, meta: TritonMetadata) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hk, D]. Returns [T, H, D] in q's dtype."""
        from tokenmill.layers.attention_backends import triton_kernel as tk

        k_cache, v_cache = layer.k_cache, layer.v_cache
        Hk, D = k_cache.shape[2], k_cache.shape[3]
        dtype = k_cache.dtype
        if kv_quant.is_quantized(dtype):
            kv_quant.write_reference(layer, k, v, meta.slot_mapping)
        else:
            k_cache.view(-1, Hk, D).index_copy_(0, meta.slot_mapping, k.to(dtype))
            v_cache.view(-1, Hk, D).index_copy_(0, meta.slot_mapping, v.to(dtype))
        fmt = tk.INT8 if dtype == torch.int8 else tk.FP8 if dtype == kv_quant.FP8 else tk.FLOAT
        if fmt == tk.FP8:  # its bits, decoded in the kernel
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        q = q.contiguous()
        out = torch.empty_like(q)
        if meta.tile_req.numel():
            tk.launch(q, k_cache, v_cache, layer.k_scale_cache, layer.v_scale_cache, out, meta.block_table,
                      meta.tile_req, meta.tile_first, meta.query_start, meta.query_len, meta.kv_len,
                      float(layer.scale), layer.logits_soft_cap, float(layer.k_scale), float(layer.v_scale),
                      layer.sliding_window, fmt, BLOCK_M, BLOCK_N,
                      None if layer.sinks is None else layer.sinks.float().contiguous())
        if meta.tree_group is not None:
            attend_group(layer, q, meta.tree_group, out)
        return out
