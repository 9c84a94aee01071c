"""MXFP4 expert weights, as gpt-oss checkpoints ship them (quantization_config {"quant_method": "mxfp4"}).

OCP microscaling FP4: each block of 32 consecutive input columns of a weight row holds 32 e2m1 values (4 bits:
sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), two a byte (element 2i in
the low nibble, 2i+1 in the high one), and one e8m0 scale byte (2^(s - 127)) for the block. The checkpoint stores
an expert weight of [E, rows, cols] (rows the output features, as F.linear reads them) as `<name>_blocks` uint8
[E, rows, cols/32, 16] and `<name>_scales` uint8 [E, rows, cols/32]; only the experts are quantized (attention,
router, embeddings and head stay float: `modules_to_not_convert`).

The weights STAY in this form in memory (4.25 bits a weight). On CPU an expert's matmul runs the native kernel
(csrc/mxfp4_linear.cpp: for a few rows of x the codes are widened to floats in registers and multiplied at once,
each weight byte read once per call; from more rows, panels decoded into an L2 buffer and SGEMM), float32 math.
Without it (no kernels built, another device, TOKENMILL_MXFP4_NATIVE=0) the matmul decodes the one expert it
needs at that moment (a 16-entry table lookup of each nibble, times its block's power of two: vectorised torch)
and multiplies; no dequantized copy of the model is ever held. The decoded values are exact in float32 (and
bfloat16), so the experts compute what the float model on the dequantized weights computes.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import native
from tokenmill.layers.quantization.base import QuantizationConfig, QuantizeMethodBase, set_weight_attrs
from tokenmill.layers.quantization.registry import checkpoint_format

if TYPE_CHECKING:
    from tokenmill.model.gpt_oss import GptOssExperts

BLOCK = 32  # values per scale
# e2m1 by its 4-bit code (sign in bit 3)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_LUT = torch.tensor(FP4_VALUES, dtype=torch.float32)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in `dtype`."""
    lut = _LUT.to(blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., G, 32]
    values = lut[codes] * torch.exp2(scales.float() - 127.0).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


NATIVE_ENV = "TOKENMILL_MXFP4_NATIVE"  # "0": the torch decode-and-multiply path even where the kernel is built


def mxfp4_linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) for W = dequantize_mxfp4(blocks [N, K/32, 16], scales [N, K/32]); x's dtype."""
    if x.device.type == "cpu" and os.environ.get(NATIVE_ENV, "1") != "0" and native.has_op("mxfp4_linear"):
        return torch.ops.tokenmill.mxfp4_linear(x, blocks, scales, bias).to(x.dtype)
    return F.linear(x, dequantize_mxfp4(blocks, scales, x.dtype), bias)


class Mxfp4Config(QuantizationConfig):
    """The checkpoint's experts are MXFP4; every linear layer stays float (no quant method for them)."""

    name = "mxfp4"

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        return None


@checkpoint_format("mxfp4")
def parse_mxfp4(raw: dict, where: str) -> Mxfp4Config:
    return Mxfp4Config()


class Mxfp4Experts:
    """gpt-oss experts (model/gpt_oss.py GptOssExperts) kept as MXFP4: gate_up_proj_{blocks,scales} with rows
    [this rank's gate rows; its up rows] (de-interleaved at load as the float form is), down_proj_{blocks,scales}
    with this rank's blocks of input columns; under expert parallelism, this rank's experts only, whole."""

    def create_weights(self, layer: "GptOssExperts", dtype: torch.dtype) -> None:
        E, H, s = layer.num_local, layer.hidden_size, layer.shard
        for name, cols in (("hidden size", H), ("expert intermediate size per rank", s)):
            if cols % BLOCK:
                raise ValueError(f"mxfp4 experts need a {name} that is a multiple of {BLOCK}, not {cols}")
        u8 = torch.uint8
        layer.gate_up_proj_blocks = _param(torch.zeros(E, 2 * s, H // BLOCK, 16, dtype=u8),
                                           lambda p, w, shard_id=None: self._load_gate_up(layer, p, w, 16))
        layer.gate_up_proj_scales = _param(torch.zeros(E, 2 * s, H // BLOCK, dtype=u8),
                                           lambda p, w, shard_id=None: self._load_gate_up(layer, p, w, None))
        layer.down_proj_blocks = _param(torch.zeros(E, H, s // BLOCK, 16, dtype=u8),
                                        lambda p, w, shard_id=None: self._load_down(layer, p, w, 16))
        layer.down_proj_scales = _param(torch.zeros(E, H, s // BLOCK, dtype=u8),
                                        lambda p, w, shard_id=None: self._load_down(layer, p, w, None))

    @staticmethod
    def _load_gate_up(layer: "GptOssExperts", param: torch.Tensor, loaded: torch.Tensor, tail: int | None) -> None:
        from tokenmill.layers.linear import check_shape  # here: linear imports this package (a cycle at import)

        check_shape(loaded, (layer.num_experts, 2 * layer.intermediate_size, layer.hidden_size // BLOCK)
                    + ((tail,) if tail else ()))
        param.data.copy_(layer.gate_up_rows(loaded))

    @staticmethod
    def _load_down(layer: "GptOssExperts", param: torch.Tensor, loaded: torch.Tensor, tail: int | None) -> None:
        from tokenmill.layers.linear import check_shape

        check_shape(loaded, (layer.num_experts, layer.hidden_size, layer.intermediate_size // BLOCK)
                    + ((tail,) if tail else ()))
        g = layer.shard // BLOCK
        param.data.copy_(layer.local_experts(loaded).narrow(2, layer.tp_rank * g, g))

    def linear(self, layer: "GptOssExperts", name: str, e: int, x: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        """x [n, cols] @ expert e's weight ("gate_up" or "down")^T (+ bias), straight from its blocks."""
        if name == "gate_up":
            return mxfp4_linear(x, layer.gate_up_proj_blocks[e], layer.gate_up_proj_scales[e], bias)
        return mxfp4_linear(x, layer.down_proj_blocks[e], layer.down_proj_scales[e], bias)


def _param(t: torch.Tensor, loader) -> nn.Parameter:
    p = nn.Parameter(t, requires_grad=False)
    set_weight_attrs(p, {"weight_loader": loader})
    return p
