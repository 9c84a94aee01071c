"""FP8 checkpoints: `weight` float8_e4m3fn [N, K] with `weight_scale`, W = weight * scale.

The scale is one float per tensor (a scalar, or shape [1]) or one per output channel ([N] or [N, 1]),
as published by FP8 checkpoints (quant_method "fp8", or compressed-tensors with float 8-bit weights
and tensor/channel strategy). A fused layer (qkv, gate_up) gets one per-tensor scale per part, so the
scale is kept per output row (float32 [N], 4 bytes a row): a lossless form of both kinds. The weight
stays 1 byte per element. `input_scale` (static activation scales) is ignored: activations stay float.

On CPU `apply` runs the native kernel (csrc/fp8_linear.cpp: bytes widened to float in registers for
decode, one conversion + SGEMM for batches); the fallback, and the reference it is tested against,
converts a tile of rows at a time to float32 (bounded temporary memory), scales it and multiplies: the
numerics of the float layer on the dequantized weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import native
from tokenmill.layers.quantization.base import QuantizationConfig, QuantizeMethodBase, set_weight_attrs
from tokenmill.layers.quantization.registry import checkpoint_format
from tokenmill.layers.quantization.weight_only import _native_ok  # one switch for every packed format

FP8 = torch.float8_e4m3fn
TILE_ELEMENTS = 1 << 20  # weights converted to float32 per step of apply (4 MiB)


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (weight * scale[:, None])^T (+ bias), float32 math; returns x's dtype."""
    N, K = weight.shape
    x2 = x.reshape(-1, K)
    if _native_ok(x2) and native.has_op("fp8_linear"):
        y = torch.ops.tokenmill.fp8_linear(x2, weight, scale, bias)
        return y.to(x.dtype).reshape(*x.shape[:-1], N)
    x2 = x2.float()
    b = None if bias is None else bias.float()
    rows = max(1, TILE_ELEMENTS // max(K, 1))
    if rows >= N:
        y = F.linear(x2, dequantize_fp8(weight, scale), b)
    else:
        y = torch.cat([F.linear(x2, dequantize_fp8(weight[n:n + rows], scale[n:n + rows]),
                                None if b is None else b[n:n + rows]) for n in range(0, N, rows)], dim=-1)
    return y.to(x.dtype).reshape(*x.shape[:-1], N)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return weight.float() * scale.float()[:, None]


class Fp8Config(QuantizationConfig):
    name = "fp8"

    def __init__(self, ignored: tuple[str, ...] = ()) -> None:
        # layers the checkpoint keeps in float (compressed-tensors "ignore"), without the "model." prefix
        self.ignored = tuple(p.removeprefix("model.") for p in ignored)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from tokenmill.layers.quantization.gptq_awq import skipped

        if skipped(prefix, self.ignored):
            return None
        return Fp8LinearMethod()


@checkpoint_format("fp8")
def parse_fp8(raw: dict, where: str) -> Fp8Config:
    if raw.get("weight_block_size"):  # DeepSeek-V3's form: scales per block (fp8_block.py)
        from tokenmill.layers.quantization.fp8_block import parse_block

        return parse_block(raw, where)
    return Fp8Config(tuple(raw.get("modules_to_not_convert") or ()))


# Named "fp8" once loaded, so `--quantization fp8` agrees with it; no flag of its own.
@checkpoint_format("compressed-tensors", flag=False, label="compressed-tensors fp8")
def parse_compressed_tensors(raw: dict, where: str) -> Fp8Config:
    groups = raw.get("config_groups") or {}
    for name, group in groups.items():
        w = group.get("weights") or {}
        if (w.get("num_bits"), w.get("type")) != (8, "float") or w.get("strategy") not in ("tensor", "channel"):
            raise ValueError(f"{where}: compressed-tensors group {name!r} ({w}) is not supported: only float 8-bit "
                             "weights with a tensor or channel strategy")
        if group.get("targets") not in (["Linear"], None):
            raise ValueError(f"{where}: compressed-tensors group {name!r} targets {group.get('targets')}; only "
                             "['Linear'] is supported")
    if not groups:
        raise ValueError(f"{where}: compressed-tensors without config_groups")
    ignored = tuple(i for i in raw.get("ignore") or () if not i.startswith("re:"))
    if len(ignored) != len(raw.get("ignore") or ()):
        raise ValueError(f"{where}: compressed-tensors regex ignore patterns are not supported")
    return Fp8Config(ignored)


class Fp8LinearMethod(QuantizeMethodBase):
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        N = sum(output_partition_sizes)
        loader = extra_weight_attrs.pop("weight_loader")
        weight = nn.Parameter(torch.empty(N, input_size_per_partition, dtype=FP8), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs,
                                  "weight_loader": lambda p, t, shard_id=None: _load_weight(loader, p, t, shard_id)})
        layer.register_parameter("weight", weight)
        scale = nn.Parameter(torch.empty(N, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(scale, {"output_dim": 0, **extra_weight_attrs,
                                 "weight_loader": lambda p, t, shard_id=None: _load_scale(layer, loader, p, t,
                                                                                          shard_id)})
        layer.register_parameter("weight_scale", scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_matmul(x, layer.weight, layer.weight_scale, bias)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return dequantize_fp8(layer.weight, layer.weight_scale)


def _load_weight(loader, param: torch.Tensor, loaded: torch.Tensor, shard_id) -> None:
    if loaded.dtype != FP8:
        raise ValueError(f"has dtype {loaded.dtype}, expected {FP8} (an fp8 checkpoint)")
    loader(param, loaded, shard_id)


def _load_scale(layer: nn.Module, loader, param: torch.Tensor, loaded: torch.Tensor, shard_id) -> None:
    """A per-tensor scale is spread over the rows of its part; a per-channel one ([N] or [N, 1]) is
    loaded like a bias. The layer's loader then cuts this rank's rows and places the part."""
    rows = _part_rows(layer, shard_id)
    if loaded.numel() == 1:
        loaded = loaded.reshape(1).float().expand(rows)
    elif loaded.dim() == 2 and loaded.shape[1] == 1:
        loaded = loaded[:, 0]
    if loaded.dim() != 1:
        raise ValueError(f"has shape {tuple(loaded.shape)}: expected a scalar (per tensor) or [{rows}] / "
                         f"[{rows}, 1] (per output channel)")
    if not torch.isfinite(loaded).all():
        raise ValueError("holds non-finite scales")
    loader(param, loaded.float(), shard_id)


def _part_rows(layer: nn.Module, shard_id) -> int:
    """Rows of the checkpoint tensor that fills `shard_id` of `layer` (all of its rows when None)."""
    if shard_id is None:
        return layer.output_size
    if shard_id == "q":
        return layer.total_num_heads * layer.head_size
    if shard_id in ("k", "v"):
        return layer.total_num_kv_heads * layer.head_size
    return layer.output_sizes[shard_id]
