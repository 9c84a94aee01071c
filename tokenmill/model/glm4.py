"""GLM-4 (transformers' Glm4ForCausalLM, GLM-4-0414; and GlmForCausalLM, the first GLM-4 release).

The Llama decoder with: q/k/v bias but none on o_proj; rotary on the first `partial_rotary_factor` (0.5) of each
head, interleaved (GPT-J style pairs 2i, 2i+1); a fused `mlp.gate_up_proj` in the checkpoint, loaded whole into
the packed layer. GLM-4-0414 also norms each block's output: its four norms are Gemma's sandwich under other
names (post_self_attn_layernorm on the attention output, post_attention_layernorm before the MLP,
post_mlp_layernorm after it), renamed at load; its RMSNorms are plain (w, not 1 + w).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tokenmill.layers.quantization.base import QuantizationConfig
from tokenmill.model.blocks import DecoderForCausalLM, DecoderSpec
from tokenmill.model.gguf_arch import GGUFArch, GGUFConfig, GGUFMeta, head_dim_of, partial_rope_kwargs
from tokenmill.model.hf_config import hf_get
from tokenmill.model.llama import llama_spec
from tokenmill.model.registry import register_gguf, register_model
from tokenmill.model.weights import WeightNaming

# GLM-4-0414's norm -> the sandwich layer's (a swap: its post_attention_layernorm is the pre-MLP norm).
GLM4_NORMS = {
    "post_self_attn_layernorm": "post_attention_layernorm",
    "post_attention_layernorm": "pre_feedforward_layernorm",
    "post_mlp_layernorm": "post_feedforward_layernorm",
}


@dataclass(frozen=True)
class Glm4Naming(WeightNaming):
    def param_name(self, name: str, tied: bool) -> str | None:
        name = super().param_name(name, tied)
        if name is None:
            return None
        parts = name.split(".")
        return ".".join(GLM4_NORMS.get(p, p) for p in parts)


def glm_spec(cfg, sandwich: bool) -> DecoderSpec:
    spec = llama_spec(cfg)
    a = spec.attention
    rope = hf_get(cfg, "rope_parameters") or {}
    partial = float(rope.get("partial_rotary_factor", hf_get(cfg, "partial_rotary_factor", 0.5)) or 1.0)
    rotary_dim = int(a.head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= a.head_dim:
        raise ValueError(f"GLM partial_rotary_factor={partial} gives {rotary_dim} rotary features of a "
                         f"{a.head_dim}-wide head: it must be an even number up to the head size")
    attention = replace(a, qkv_bias=bool(hf_get(cfg, "attention_bias", True)), o_bias=False,
                        rotary_dim=None if rotary_dim == a.head_dim else rotary_dim, rotary_interleaved=True)
    return replace(spec, attention=attention, sandwich_norms=sandwich)


@register_model("GlmForCausalLM")
class GlmForCausalLM(DecoderForCausalLM):
    # q/k/v are separate in the checkpoint; gate_up_proj is already fused
    packed_modules_mapping: dict[str, list[str]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    sandwich = False

    def __init__(self, cfg, dtype: torch.dtype, compute_dtype: torch.dtype, max_positions: int,
                 quant_config: QuantizationConfig | None = None, tp_rank: int = 0, tp_size: int = 1,
                 expert_parallel: bool = False, pp_rank: int = 0, pp_size: int = 1) -> None:
        super().__init__(cfg, glm_spec(cfg, self.sandwich), dtype, compute_dtype, max_positions, quant_config,
                         tp_rank, tp_size, expert_parallel, pp_rank, pp_size)


@register_model("Glm4ForCausalLM")
class Glm4ForCausalLM(GlmForCausalLM):
    weight_naming = Glm4Naming()
    sandwich = True


def glm4_gguf_config(m: GGUFMeta, generic: GGUFConfig) -> GGUFConfig:
    """Partial rotary from rope.dimension_count (half of the head when absent); q/k/v bias when the file has it."""
    return generic.updated(**partial_rope_kwargs(m, generic.kwargs, head_dim_of(generic.kwargs) // 2),
                           attention_bias="blk.0.attn_q.bias" in m.tensors or "blk.0.attn_qkv.bias" in m.tensors)


# GLM-4-0414 as llama.cpp writes it: ffn_up is the fused gate_up; its norms are the sandwich under other names
# (llama.cpp's post_attention_norm is the checkpoint's post_self_attn_layernorm, ffn_norm its pre-MLP
# post_attention_layernorm). No Q/K permutation: both sides interleave. (GLM-4's first release is llama.cpp's
# `chatglm`, with a fused attn_qkv: no mapping here.)
register_gguf(GGUFArch("glm4", "Glm4Config", "Glm4ForCausalLM", partial_rope=True, config=glm4_gguf_config,
                       extra_parts={"ffn_up": "mlp.gate_up_proj",
                                    "post_attention_norm": "post_self_attn_layernorm",
                                    "ffn_norm": "post_attention_layernorm",
                                    "post_ffw_norm": "post_mlp_layernorm"}))
