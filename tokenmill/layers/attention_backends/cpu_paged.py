"""Native paged attention on the CPU (tokenmill/csrc/paged_attention.cpp).

One kernel call per layer writes the step's K/V into the paged cache and attends, reading each
request's K/V blocks where they lie: decodes walk their block tables once per KV head (all query
heads of a GQA group share the pass; long contexts split over threads and merged), prompt chunks
attend tile by tile over their cached prefix and themselves. Nothing is gathered, padded or masked
beyond a request's own visible keys, so unwritten cache slots are never read and need no zeroing.
Same cache layout as torch_sdpa: [num_blocks, block_size, Hk, D].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill import native
from tokenmill.layers.attention_backends import kv_quant
from tokenmill.layers.attention_backends.base import AttentionBackend, BatchLayout
from tokenmill.layers.attention_backends.registry import register_backend
from tokenmill.layers.attention_backends.torch_sdpa import SDPAGroup, attend_group, tree_group

if TYPE_CHECKING:
    from tokenmill.layers.attention import Attention

CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.int8, kv_quant.FP8)


@dataclass
class CPUPagedMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    block_table: torch.Tensor  # [B, max_blocks] int32
    query_start: torch.Tensor  # [B] int32
    query_len: torch.Tensor  # [B] int32
    kv_len: torch.Tensor  # [B] int32
    # Requests verifying draft trees: the kernel attends causally, so their rows are attended again in torch
    # with the tree mask (torch_sdpa's group, unwritten slots zeroed out of the gathered keys).
    tree_group: SDPAGroup | None = None


@register_backend
class CPUPagedBackend(AttentionBackend):
    name = "cpu_paged"

    @property
    def supports_sinks(self) -> bool:  # the op came with the sinks; a build from before lacks it
        return native.has_op("paged_attention_sinks")

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        return torch.device(device).type == "cpu" and native.available()

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        if torch.device(device).type != "cpu":
            return "CPU only"
        return native.load()

    @classmethod
    def describe(cls) -> str:
        return f"{cls.name} (native kernels, {native.tier()} build, {native.cpu_capability()} vectors)"

    def kv_cache_shape(self, num_blocks: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, num_kv_heads, head_dim)

    def allocate_kv_cache(self, layers: list[Attention], num_blocks: int, dtype: torch.dtype) -> None:
        self.check_layers(layers, dtype)
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"cpu_paged attention keeps its KV cache in float32 or bfloat16 (or quantized: int8, "
                             f"float8_e4m3fn), not {dtype}; "
                             "use --attention-backend torch_sdpa for other cache dtypes")
        for a in layers:
            shape = self.kv_cache_shape(num_blocks, a.num_kv_heads, a.head_dim)
            # Never zeroed: the kernel reads only slots written before (a request's visible keys).
            kv_quant.allocate(a, shape, dtype, self.device)
            a.backend = self

    def build_metadata(self, layout: BatchLayout) -> CPUPagedMetadata:
        i32 = torch.int32
        return CPUPagedMetadata(
            slot_mapping=layout.slot_mapping.to(torch.long).contiguous(),
            block_table=layout.block_table.to(i32).contiguous(),
            query_start=layout.query_start.to(i32).contiguous(),
            query_len=layout.query_len.to(i32).contiguous(),
            kv_len=layout.kv_len.to(i32).contiguous(),
            tree_group=tree_group(layout, self.block_size, self.device),
        )

    def forward(self, layer: Attention, q, k, v, meta: CPUPagedMetadata) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hk, D]. Returns [T, H, D] in q's dtype."""
        cache_dtype = layer.k_cache.dtype
        qf = q.to(torch.float32).contiguous()
        out = torch.empty_like(qf)
        if layer.sinks is not None:
            return self._forward_sinks(layer, q, qf, k, v, out, meta)
        if kv_quant.is_quantized(cache_dtype):
            return self._forward_quantized(layer, q, qf, k, v, out, meta)
        torch.ops.tokenmill.paged_attention(
            out, qf, k.to(cache_dtype).contiguous(), v.to(cache_dtype).contiguous(), layer.k_cache, layer.v_cache,
            meta.slot_mapping, meta.block_table, meta.query_start, meta.query_len, meta.kv_len,
            float(layer.scale), int(layer.sliding_window or 0), float(layer.logits_soft_cap or 0.0))
        if meta.tree_group is not None:
            attend_group(layer, qf, meta.tree_group, out)
        return out if q.dtype == torch.float32 else out.to(q.dtype)

    def _forward_quantized(self, layer: Attention, q, qf, k, v, out, meta: CPUPagedMetadata) -> torch.Tensor:
        """int8 / fp8 caches: the kernel quantizes the new float32 K/V as it writes them."""
        ks = layer.k_scale_cache if layer.k_scale_cache is not None else _NO_SCALES
        vs = layer.v_scale_cache if layer.v_scale_cache is not None else _NO_SCALES
        torch.ops.tokenmill.paged_attention_quant(
            out, qf, k.to(torch.float32).contiguous(), v.to(torch.float32).contiguous(), layer.k_cache, layer.v_cache,
            ks, vs, meta.slot_mapping, meta.block_table, meta.query_start, meta.query_len, meta.kv_len,
            float(layer.scale), int(layer.sliding_window or 0), float(layer.logits_soft_cap or 0.0),
            float(layer.k_scale), float(layer.v_scale))
        if meta.tree_group is not None:
            attend_group(layer, qf, meta.tree_group, out)
        return out if q.dtype == torch.float32 else out.to(q.dtype)


    def _forward_sinks(self, layer: Attention, q, qf, k, v, out, meta: CPUPagedMetadata) -> torch.Tensor:
        """gpt-oss's sinks: one op for float and quantized caches (new K/V in the cache dtype, or float32 to quantize)."""
        dtype = layer.k_cache.dtype
        new_dtype = torch.float32 if kv_quant.is_quantized(dtype) else dtype
        ks = layer.k_scale_cache if layer.k_scale_cache is not None else _NO_SCALES
        vs = layer.v_scale_cache if layer.v_scale_cache is not None else _NO_SCALES
        torch.ops.tokenmill.paged_attention_sinks(
            out, qf, k.to(new_dtype).contiguous(), v.to(new_dtype).contiguous(), layer.k_cache, layer.v_cache, ks, vs,
            meta.slot_mapping, meta.block_table, meta.query_start, meta.query_len, meta.kv_len,
            float(layer.scale), int(layer.sliding_window or 0), float(layer.logits_soft_cap or 0.0),
            float(layer.k_scale), float(layer.v_scale), layer.sinks.float().contiguous())
        if meta.tree_group is not None:
            attend_group(layer, qf, meta.tree_group, out)
        return out if q.dtype == torch.float32 else out.to(q.dtype)


_NO_SCALES = torch.empty(0)  # fp8: its per-layer scales are plain floats
