"""Weights quantized at load from any float checkpoint, activations in float32 (`--quantization int8|int4`).

- int8: one symmetric scale per output row (per channel): w = q * scale, q in [-127, 127].
- int4: groups of `group_size` input columns (32, 64 or 128), asymmetric (w = (q - zero) * scale, q in
  [0, 15], the group's min and max at levels 0 and 15, zero a float) or symmetric (zero = 8); two values
  per byte, the even column in the low nibble.

The layer loads its float weight as usual (same loaders, same tensor-parallel shards), then
`process_weights_after_loading` replaces it by the packed form as soon as the layer's last tensor is in, so
only one layer's float weight is resident at a time and only the packed bytes stay (the loader gives back
the file pages the float weight was read from: model/mapped_pages.py).
`apply` runs the native kernel (tokenmill/csrc/quant_linear.cpp: dequantize a tile in registers/L1, then
multiply) on CPU, else dequantizes the weight and calls F.linear: the reference the kernel is tested
against, and the path for devices without one.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.quantization.base import NativeLinear, QuantizationConfig, QuantizeMethodBase, layer_name
from tokenmill.layers.quantization.registry import QuantOptions, quantize_at_load
from tokenmill.layers.quantization.unquantized import UnquantizedLinearMethod

INT4_GROUP_SIZES = (32, 64, 128)


_NATIVE: bool | None = None


def _native_ok(x: torch.Tensor) -> bool:
    """The kernels are built (and new enough to have the quantized linears) and x is on the CPU."""
    global _NATIVE
    if x.device.type != "cpu":
        return False
    if _NATIVE is None:
        from tokenmill import native

        _NATIVE = native.has_op("int4_linear")
    return _NATIVE


def _swap(layer: nn.Module, **packed: torch.Tensor) -> None:
    """Drop the float weight; register the packed tensors (parameters, so weight-byte counts see them)."""
    del layer.weight
    for name, t in packed.items():
        layer.register_parameter(name, nn.Parameter(t.contiguous(), requires_grad=False))


# Rows quantized per step: ~4 MiB of float32, so the temporaries of packing a matrix stay small whatever
# its size (the LM head: 108 MiB in float32 for SmolLM2). Every step is row-wise: the same bytes as at once.
_CHUNK_ELEMENTS = 1 << 20


def _row_chunks(w: torch.Tensor) -> range:
    return range(0, w.shape[0], max(1, _CHUNK_ELEMENTS // max(1, w.shape[1])))


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (int8 [N, K], float32 scale [N]): per row, scale = max|w| / 127."""
    N, K = w.shape
    q = torch.empty(N, K, dtype=torch.int8, device=w.device)
    scale = torch.empty(N, dtype=torch.float32, device=w.device)
    rows = _row_chunks(w)
    for r in rows:
        c = w[r : r + rows.step].float()
        s = (c.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
        q[r : r + rows.step] = torch.round(c / s[:, None]).clamp_(-127, 127)
        scale[r : r + rows.step] = s
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


def quantize_int4(w: torch.Tensor, group: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (packed uint8 [N, K/2], scale [N, K/group], zero [N, K/group]) float32.

    Asymmetric: the group's min and max are levels 0 and 15 (zero = -min / scale, a float), as GGUF's Q4_1:
    the whole range buys resolution, and weights that already sit on a 16-level grid per group (a Q4_1
    checkpoint dequantized) are reproduced exactly instead of quantized twice. Symmetric: zero = 8, so a
    weight of 0 stays exactly 0."""
    N, K = w.shape
    packed = torch.empty(N, K // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(N, K // group, dtype=torch.float32, device=w.device)
    zero = torch.empty_like(scale)
    rows = _row_chunks(w)
    for r in rows:
        rs = slice(r, r + rows.step)
        packed[rs], scale[rs], zero[rs] = _quantize_int4_rows(w[rs], group, symmetric)
    return packed, scale, zero


def _quantize_int4_rows(w: torch.Tensor, group: int,
                        symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    N, K = w.shape
    g = w.float().reshape(N, K // group, group)
    tiny = torch.finfo(torch.float32).tiny
    if symmetric:
        scale = (g.abs().amax(dim=-1) / 7.0).clamp(min=tiny)
        zero = torch.full_like(scale, 8.0)
        q = torch.round(g / scale[..., None]) + 8.0
    else:
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        # A (nearly) constant group keeps a scale near its magnitude's float resolution, so zero = -lo /
        # scale stays finite.
        scale = torch.maximum((hi - lo) / 15.0, torch.maximum(lo.abs(), hi.abs()) * 2.0**-20).clamp(min=tiny)
        zero = -lo / scale
        q = torch.round((g - lo[..., None]) / scale[..., None])
    q = q.clamp_(0, 15).to(torch.uint8).reshape(N, K)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed, scale, zero


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> torch.Tensor:
    N = packed.shape[0]
    q = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(N, -1).float()
    K = q.shape[1]
    return ((q.reshape(N, K // group, group) - zero[..., None]) * scale[..., None]).reshape(N, K)


def packed_matmul(x: torch.Tensor, native, dequantize, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T for a packed W: `native(x2d, bias)` (the kernel) on CPU, else F.linear on
    `dequantize()`, the reference. Returns x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    if _native_ok(x2):
        y = native(x2, bias)
    else:
        y = F.linear(x2.float(), dequantize(), None if bias is None else bias.float())
    return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                int8_activations: bool = False, per_token: bool = False) -> torch.Tensor:
    if per_token:
        return int8_per_token_matmul(x, q, scale, bias)
    return packed_matmul(x, lambda x2, b: torch.ops.tokenmill.int8_linear(x2, q, scale, b, int8_activations),
                         lambda: dequantize_int8(q, scale), bias)


@functools.cache
def _per_token_op() -> bool:
    from tokenmill import native

    return native.has_op("int8_linear_per_token")


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> int8 [M, K] and one scale per row [M, 1] (max|row| / 127; 0 for an all-zero row)."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(x * inv).clamp_(-127, 127).to(torch.int8), amax / 127.0


def int8_per_token_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 (`--activation-quantization int8_per_token` on int8 weights, vLLM's dynamic per-token scheme): each
    row of x quantized to int8 with one scale, multiplied with the int8 weight rows in exact int32
    (`torch._int_mm`: oneDNN's VNNI / AMX kernels on CPU, 4-5x float32 from 16 rows on an AVX-512 VNNI core),
    then scaled by the row's and the weight row's scales. The integer sums are exact, whatever kernel or blocking
    the library picks for this M, so a row's result never depends on the rest of the batch."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.device.type == "cpu" and _per_token_op():
        y = torch.ops.tokenmill.int8_linear_per_token(x2, q, scale, bias)  # csrc/w8a8_linear.cpp: the same, fused
    else:
        xq, sx = quantize_rows_int8(x2.float())
        # torch._int_mm's CUDA kernel wants M > 16: elsewhere the same integers, summed in float
        acc = torch._int_mm(xq, q.t()).float() if x2.device.type == "cpu" else xq.float() @ q.t().float()
        y = acc * sx * scale
        if bias is not None:
            y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], q.shape[0])


class _WeightOnlyMethod(UnquantizedLinearMethod):
    """Creates the float weight like the unquantized method (so loading is unchanged), packs it after."""

    # Packed as soon as the layer's last tensor is loaded (model/weights.py), one layer's float weight at a time.
    process_when_loaded = True

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return packed_matmul(x, lambda x2, b: self._native(layer, x2, b), lambda: self.dequantize(layer), bias)


class Int8LinearMethod(_WeightOnlyMethod):
    def __init__(self, int8_activations: bool = False, per_token: bool = False) -> None:
        self.int8_activations = int8_activations
        self.per_token = per_token  # int8_per_token: W8A8 through torch._int_mm (int8_per_token_matmul)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.per_token:
            return int8_per_token_matmul(x, layer.qweight, layer.scale, bias)
        return super().apply(layer, x, bias)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scale = quantize_int8(layer.weight.data)
        _swap(layer, qweight=q, scale=scale)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return dequantize_int8(layer.qweight, layer.scale)

    def _native(self, layer, x, bias):
        return torch.ops.tokenmill.int8_linear(x, layer.qweight, layer.scale, bias, self.int8_activations)

    def native_linear(self, layer: nn.Module) -> NativeLinear | None:
        if self.per_token:
            return NativeLinear("int8_per_token", layer.qweight, layer.bias, scale=layer.scale)
        return NativeLinear("int8", layer.qweight, layer.bias, scale=layer.scale,
                            int8_activations=self.int8_activations)


class Int4LinearMethod(_WeightOnlyMethod):
    def __init__(self, group_size: int, symmetric: bool, int8_activations: bool = False) -> None:
        self.group_size = group_size
        self.symmetric = symmetric
        self.int8_activations = int8_activations

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        if input_size_per_partition % self.group_size:
            raise ValueError(f"int4 group size {self.group_size} does not divide the input size "
                             f"{input_size_per_partition} of layer {layer_name(layer)}")
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                               params_dtype, **extra_weight_attrs)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        packed, scale, zero = quantize_int4(layer.weight.data, self.group_size, self.symmetric)
        _swap(layer, qweight=packed, scale=scale, zero=zero)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return dequantize_int4(layer.qweight, layer.scale, layer.zero, self.group_size)

    def _native(self, layer, x, bias):
        return torch.ops.tokenmill.int4_linear(x, layer.qweight, layer.scale, layer.zero, self.group_size, bias,
                                               self.int8_activations)

    def native_linear(self, layer: nn.Module) -> NativeLinear | None:
        return NativeLinear("int4", layer.qweight, layer.bias, scale=layer.scale, zero=layer.zero,
                            group=self.group_size, int8_activations=self.int8_activations)


class WeightOnlyConfig(QuantizationConfig):
    """Every linear layer of the decoder (not the embedding or LM head) quantized at load."""

    def __init__(self, name: str, group_size: int = 32, symmetric: bool = False,
                 int8_activations: bool = False, per_token_activations: bool = False) -> None:
        if name not in ("int8", "int4"):
            raise ValueError(f"unknown weight-only quantization {name!r}")
        if name == "int4" and group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}.")
        self.name = name
        self.group_size = group_size
        self.symmetric = symmetric
        self.int8_activations = int8_activations  # --activation-quantization int8
        self.per_token_activations = per_token_activations and name == "int8"  # int8_per_token: W8A8
        # The LM head (and a tied embedding) as int8 rows: the largest matrix read per token at batch 1.
        self.quantize_lm_head = True

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if self.name == "int8":
            return Int8LinearMethod(self.int8_activations, self.per_token_activations)
        return Int4LinearMethod(self.group_size, self.symmetric, self.int8_activations)


@quantize_at_load("int8")
def int8_config(options: QuantOptions) -> WeightOnlyConfig:
    return WeightOnlyConfig("int8", options.group_size, options.symmetric, options.int8_activations,
                            options.per_token_activations)


@quantize_at_load("int4")
def int4_config(options: QuantOptions) -> WeightOnlyConfig:
    return WeightOnlyConfig("int4", options.group_size, options.symmetric, options.int8_activations)
