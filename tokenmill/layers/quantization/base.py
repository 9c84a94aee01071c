"""The seam between a linear layer and how its weights are stored: a quantize method creates the
layer's weight parameters and computes with them, so a layer never assumes a dense float weight."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class NativeLinear:
    """A linear layer as the native decoder stack runs it (csrc/decoder_stack.cpp, model/native_stack.py):
    which kernel (`kind`: dense, gguf, int8, int4, int8_per_token) and its operands, the same the method's `apply` passes."""

    kind: str
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    qtype: int = 0  # gguf: the ggml block type
    K: int = 0  # gguf: input columns
    group: int = 0  # int4: columns per scale
    int8_activations: bool = False
    bf16_batches: bool = False  # gguf: batches of 32+ rows as bf16 GEMMs (--quantized-batch-dtype bfloat16)


class QuantizeMethodBase(ABC):
    """How one linear layer stores and applies its weights."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        """Register this rank's weight parameters on `layer`. `output_partition_sizes` are the widths of
        the packed parts (q/k/v, gate/up) on this rank; `extra_weight_attrs` (e.g. `weight_loader`)
        are set on every parameter created."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x W^T (+ bias) for this rank's shard."""

    # True: the loader calls process_weights_after_loading as soon as this layer's tensors are all in,
    # instead of after the whole checkpoint (a method that packs a float weight frees it layer by layer).
    process_when_loaded: bool = False

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack or convert weights once the checkpoint is in (default: keep them as loaded)."""

    def native_linear(self, layer: nn.Module) -> NativeLinear | None:
        """This layer's matmul for the native decoder stack: the same kernel and operands `apply` uses on a
        float32 CPU input, or None when `apply` does something the stack does not (then the model keeps its
        Python layers). Default: None."""
        return None


class QuantizationConfig(ABC):
    """A checkpoint's quantization scheme: picks the method for each layer."""

    name: str = ""
    # What the loader asks of every scheme (model/loader.py); the formats that quantize the LM head (int8 weight-only)
    # set these, the others keep the head in the checkpoint's format.
    quantize_lm_head: bool = False
    int8_activations: bool = False
    per_token_activations: bool = False

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method for `layer` (its dotted name is `prefix`); None keeps it unquantized."""


def layer_name(layer: nn.Module) -> str:
    """A layer's dotted name for error messages ("?" when unknown)."""
    return getattr(layer, "prefix", "") or "?"  # getattr: a LinearBase has a prefix; bare nn.Modules (tests) not


def set_weight_attrs(param: torch.Tensor, attrs: dict | None) -> None:
    for key, value in (attrs or {}).items():
        if hasattr(param, key):
            raise AttributeError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


def weight_attr(param: torch.Tensor, key: str, default=None):
    """An attribute set_weight_attrs gave `param` (weight_loader, input_dim, output_dim, pack_factors), or default."""
    return getattr(param, key, default)  # getattr: set on some parameters only, by their quant method or layer
