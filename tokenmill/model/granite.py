"""IBM Granite (3.x dense, transformers' GraniteForCausalLM): the Llama decoder with four multipliers.

The embeddings are multiplied by `embedding_multiplier`; each attention and MLP output by
`residual_multiplier` before it joins the residual stream; the attention softmax scale is
`attention_multiplier` (not head_dim ** -0.5); and the logits are divided by `logits_scaling`.
A multiplier of 1 is left out of the spec, so such a layer stays eligible for the native decoder stack.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from tokenmill.layers.quantization.base import QuantizationConfig
from tokenmill.model.blocks import DecoderForCausalLM, DecoderSpec
from tokenmill.model.hf_config import hf_get
from tokenmill.model.gguf_arch import GGUFArch, GGUFConfig, GGUFMeta, head_dim_of
from tokenmill.model.registry import register_gguf, register_model
from tokenmill.model.llama import llama_spec


def _unless_one(value) -> float | None:
    return None if value is None or float(value) == 1.0 else float(value)


def granite_spec(cfg) -> DecoderSpec:
    spec = llama_spec(cfg)
    return replace(
        spec,
        attention=replace(spec.attention, scale=float(hf_get(cfg, "attention_multiplier", spec.attention.scale))),
        embed_scale=_unless_one(hf_get(cfg, "embedding_multiplier")),
        residual_multiplier=_unless_one(hf_get(cfg, "residual_multiplier")),
        logits_scaling=_unless_one(hf_get(cfg, "logits_scaling")),
    )


@register_model("GraniteForCausalLM")
class GraniteForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg, dtype: torch.dtype, compute_dtype: torch.dtype, max_positions: int,
                 quant_config: QuantizationConfig | None = None, tp_rank: int = 0, tp_size: int = 1,
                 expert_parallel: bool = False, pp_rank: int = 0, pp_size: int = 1) -> None:
        super().__init__(cfg, granite_spec(cfg), dtype, compute_dtype, max_positions, quant_config, tp_rank, tp_size,
                         expert_parallel, pp_rank, pp_size)


def granite_gguf_config(m: GGUFMeta, generic: GGUFConfig) -> GGUFConfig:
    """The four multipliers from llama.cpp's keys: attention.scale 0 or absent means 1/sqrt(head_dim), the others
    absent mean 1."""
    return generic.updated(embedding_multiplier=float(m("embedding_scale", 1.0) or 1.0),
                           residual_multiplier=float(m("residual_scale", 1.0) or 1.0),
                           attention_multiplier=float(m("attention.scale", 0.0) or head_dim_of(generic.kwargs)**-0.5),
                           logits_scaling=float(m("logit_scale", 1.0) or 1.0))


# llama.cpp's GraniteModel is its LlamaModel's subclass: Q/K rows permuted as Llama's
register_gguf(GGUFArch("granite", "GraniteConfig", "GraniteForCausalLM", permuted_qk=True,
                       config=granite_gguf_config))
