"""Quantized KV cache (`--kv-cache-dtype int8 | fp8 | fp8_e4m3`): formats, sizes and the torch reference.

- int8: symmetric per token and KV head: each [D] row of K (and of V) is stored as int8 with one float32
  scale, scale = max|x| / 127, q = round_half_even(x / scale). The scales live beside the cache, one
  tensor per layer for K and one for V, [num_blocks, block_size, Hk], indexed by block like the cache.
- fp8 (= fp8_e4m3): torch.float8_e4m3fn values with one scale per layer for K and one for V, q =
  saturate(x / scale). The scales come from the checkpoint's `self_attn.k_scale` / `self_attn.v_scale`
  tensors when it has them, else 1.0 (as vLLM does; e4m3 keeps values up to 448, ample for K/V).

Values are quantized when the backend writes them and dequantized when it reads them. The native kernel
(csrc/paged_attention.cpp, op paged_attention_quant) does the same arithmetic as the helpers here, so
both backends store identical bytes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tokenmill.layers.attention import Attention

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0
# vLLM's names for quantized caches -> the cache element dtype.
QUANT_KV_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": FP8, "fp8_e4m3": FP8}


def is_quantized(dtype: torch.dtype | None) -> bool:
    return dtype in (torch.int8, FP8)


def slot_scale_bytes(dtype: torch.dtype) -> int:
    """Bytes of scales per (slot, KV head) for K or V: int8 keeps one float32 each."""
    return 4 if dtype == torch.int8 else 0


def block_bytes(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one layer's block, values and scales."""
    return 2 * block_size * num_kv_heads * (head_dim * dtype.itemsize + slot_scale_bytes(dtype))


def layer_block_bytes(layer: Attention, block_size: int, dtype: torch.dtype) -> int:
    """One layer's block: K and V, or K alone where V shares it (MLA's latent cache, `Attention.kv_shared`)."""
    both = block_bytes(block_size, layer.num_kv_heads, layer.head_dim, dtype)
    return both // 2 if layer.kv_shared else both


# ---- quantize / dequantize (the reference the kernel matches) ---------------------------------------
def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D], float32 scales [...]); |dequantized - x| <= scale / 2."""
    x = x.float()
    scale = x.abs().amax(-1) / INT8_MAX
    safe = torch.where(scale > 0, scale, 1.0).unsqueeze(-1)
    q = (x / safe).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.to(torch.float32) * scale.unsqueeze(-1)).to(dtype)


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_fp8(q: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.to(torch.float32) * scale).to(dtype)


# ---- checkpoint scales ----------------------------------------------------------------------------
# FP8 checkpoints (vLLM's layout) store per-layer KV scales as self_attn.k_scale / v_scale, older ones one
# self_attn.kv_scale for both.
KV_SCALE_NAMES = ("k_scale", "v_scale", "kv_scale")


def load_kv_scale(model: torch.nn.Module, module_name: str, leaf: str, tensor: torch.Tensor) -> None:
    """Set the fp8 scale `leaf` of the attention layer under `module_name` from a checkpoint tensor."""
    from tokenmill.layers.attention import Attention

    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return  # a module this model does not have (unused extras are skipped)
    layers = [m for m in module.modules() if isinstance(m, Attention)]
    if len(layers) != 1:
        return
    if tensor.numel() != 1:
        raise ValueError(f"KV cache scale {module_name}.{leaf} must hold one value (a per-layer scale), "
                         f"got shape {tuple(tensor.shape)}")
    value = float(tensor.float().item())
    if not value > 0 or value == float("inf"):
        raise ValueError(f"KV cache scale {module_name}.{leaf} must be a positive finite number, got {value}")
    for name in (("k_scale", "v_scale") if leaf == "kv_scale" else (leaf,)):
        setattr(layers[0], name, value)


# ---- caches on attention layers ------------------------------------------------------------------
def allocate(layer: Attention, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """The layer's K/V caches in `dtype` and, for int8, their scales [num_blocks, block_size, Hk]."""
    shared = layer.kv_shared  # one tensor for both (MLA): V reads the same slots K wrote
    layer.k_cache = torch.empty(shape, dtype=dtype, device=device)
    layer.v_cache = layer.k_cache if shared else torch.empty(shape, dtype=dtype, device=device)
    if dtype == torch.int8:
        layer.k_scale_cache = torch.empty(shape[:3], dtype=torch.float32, device=device)
        layer.v_scale_cache = layer.k_scale_cache if shared else torch.empty(shape[:3], dtype=torch.float32,
                                                                             device=device)
    else:
        layer.k_scale_cache = layer.v_scale_cache = None


def layer_caches(layer: Attention) -> list[torch.Tensor]:
    """Every tensor of the layer's KV pool, block-indexed on dim 0, as KV transfer copies them: K, V, then
    int8's scales; fp8 caches as uint8 views (torch has no index_copy_ for float8)."""
    shared = layer.kv_shared  # MLA: V is K's tensor, copied once
    caches = [layer.k_cache] if shared else [layer.k_cache, layer.v_cache]
    if layer.k_cache.dtype == FP8:
        caches = [c.view(torch.uint8) for c in caches]
    if layer.k_scale_cache is not None:
        caches += [layer.k_scale_cache] if shared else [layer.k_scale_cache, layer.v_scale_cache]
    return caches


def write_reference(layer: Attention, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantize this step's K/V [T, Hk, D] into the layer's cache slots (torch reference)."""
    Hk, D = layer.k_cache.shape[2], layer.k_cache.shape[3]
    if layer.k_cache.dtype == torch.int8:
        for x, cache, scales in ((k, layer.k_cache, layer.k_scale_cache), (v, layer.v_cache, layer.v_scale_cache)):
            q, s = quantize_int8(x)
            cache.view(-1, Hk, D).index_copy_(0, slots, q)
            scales.view(-1, Hk).index_copy_(0, slots, s)
    else:
        for x, cache, scale in ((k, layer.k_cache, layer.k_scale), (v, layer.v_cache, layer.v_scale)):
            q = quantize_fp8(x, scale)
            cache.view(torch.uint8).view(-1, Hk, D).index_copy_(0, slots, q.view(torch.uint8))


def gather_dequantized(layer: Attention, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `blocks` (flat block ids) dequantized: [len(blocks), block_size, Hk, D] each."""
    if layer.k_cache.dtype == torch.int8:
        k = dequantize_int8(layer.k_cache.index_select(0, blocks), layer.k_scale_cache.index_select(0, blocks), dtype)
        v = dequantize_int8(layer.v_cache.index_select(0, blocks), layer.v_scale_cache.index_select(0, blocks), dtype)
        return k, v
    k = dequantize_fp8(layer.k_cache.index_select(0, blocks), layer.k_scale, dtype)
    v = dequantize_fp8(layer.v_cache.index_select(0, blocks), layer.v_scale, dtype)
    return k, v


def zero_blocks(layer: Attention, blocks: torch.Tensor) -> None:
    for t in layer_caches(layer):
        t.index_fill_(0, blocks, 0)
