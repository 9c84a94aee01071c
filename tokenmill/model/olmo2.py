"""OLMo 2 (transformers' Olmo2ForCausalLM): the Llama decoder with its norms moved.

No norm before attention or the MLP: each block reads the residual stream itself and its output is
normed (post_attention_layernorm, post_feedforward_layernorm) before the residual add. q and k are
RMSNorm'd over the whole projection (all heads at once, weights of num_heads * head_dim), before
rotary; under tensor parallelism each rank norms its heads with the all-reduced sum of squares of all
(blocks.ShardedHeadsRMSNorm).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from tokenmill.layers.quantization.base import QuantizationConfig
from tokenmill.model.blocks import DecoderForCausalLM, DecoderSpec
from tokenmill.model.gguf_arch import GGUFArch
from tokenmill.model.llama import llama_spec
from tokenmill.model.registry import register_gguf, register_model


def olmo2_spec(cfg) -> DecoderSpec:
    spec = llama_spec(cfg)
    return replace(spec, attention=replace(spec.attention, qk_norm=True, qk_norm_all_heads=True), post_norms=True)


@register_model("Olmo2ForCausalLM")
class Olmo2ForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg, dtype: torch.dtype, compute_dtype: torch.dtype, max_positions: int,
                 quant_config: QuantizationConfig | None = None, tp_rank: int = 0, tp_size: int = 1,
                 expert_parallel: bool = False, pp_rank: int = 0, pp_size: int = 1) -> None:
        super().__init__(cfg, olmo2_spec(cfg), dtype, compute_dtype, max_positions, quant_config, tp_rank, tp_size,
                         expert_parallel, pp_rank, pp_size)


register_gguf(GGUFArch("olmo2", "Olmo2Config", "Olmo2ForCausalLM"))  # gguf-py's map names all its tensors
