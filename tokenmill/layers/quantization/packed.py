"""Checkpoints written by `tokenmill quantize` (quant_method "tokenmill"): the int8 / int4 layers'
packed tensors exactly as `--quantization int8|int4` keeps them in memory, so loading takes them as
they are (no re-quantizing): int4 `qweight` uint8 [N, K/2] (even column in the low nibble) with
float32 `scale` and `zero` [N, K/group]; int8 `qweight` int8 [N, K] with float32 `scale` [N]."""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.quantization.base import QuantizeMethodBase, layer_name, set_weight_attrs
from tokenmill.layers.quantization.registry import checkpoint_format
from tokenmill.layers.quantization.weight_only import Int4LinearMethod, Int8LinearMethod, WeightOnlyConfig


def _param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, attrs: dict, extra: dict) -> None:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    set_weight_attrs(p, attrs)
    set_weight_attrs(p, extra)
    layer.register_parameter(name, p)


class PackedInt8Method(Int8LinearMethod):
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        N, K = sum(output_partition_sizes), input_size_per_partition
        _param(layer, "qweight", (N, K), torch.int8, {"input_dim": 1, "output_dim": 0}, extra_weight_attrs)
        _param(layer, "scale", (N,), torch.float32, {"output_dim": 0}, extra_weight_attrs)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass  # already packed


class PackedInt4Method(Int4LinearMethod):
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        N, K, g = sum(output_partition_sizes), input_size_per_partition, self.group_size
        if K % g:
            raise ValueError(f"int4 group size {g} does not divide the input size {K} of layer "
                             f"{layer_name(layer)}")
        _param(layer, "qweight", (N, K // 2), torch.uint8, {"input_dim": 1, "output_dim": 0, "pack_factors": {1: 2}},
               extra_weight_attrs)
        for name in ("scale", "zero"):
            _param(layer, name, (N, K // g), torch.float32, {"input_dim": 1, "output_dim": 0, "pack_factors": {1: g}},
                   extra_weight_attrs)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass  # already packed


class PackedConfig(WeightOnlyConfig):
    """The config.json entry: {"quant_method": "tokenmill", "method": "int4", "group_size": 32,
    "symmetric": false}. The LM head is stored in float and kept as int8 rows at load, as with
    --quantization (the same deterministic rounding, so the model is the same)."""

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if self.name == "int8":
            return PackedInt8Method()
        return PackedInt4Method(self.group_size, self.symmetric)

    def to_json(self) -> dict:
        return {"quant_method": "tokenmill", "method": self.name, "bits": 8 if self.name == "int8" else 4,
                "group_size": self.group_size if self.name == "int4" else None, "symmetric": self.symmetric}


# Named int8 / int4 once loaded, so those flags agree with it; no flag of its own.
@checkpoint_format("tokenmill", flag=False)
def parse_tokenmill(raw: dict, where: str) -> PackedConfig:
    return PackedConfig(str(raw.get("method")), int(raw.get("group_size") or 32), bool(raw.get("symmetric")))
