"""Mixture-of-experts families on the Llama-family decoder: Mixtral (top-k softmax, renormalised; its
`block_sparse_moe.` modules renamed to `mlp.`), Qwen2-MoE (q/k/v bias, a sigmoid-gated shared expert,
`norm_topk_prob`, dense layers by `decoder_sparse_step`/`mlp_only_layers`) and Qwen3-MoE (q/k RMSNorm).
Each is llama_spec plus a MoESpec; layers that stay dense use the config's `intermediate_size`."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tokenmill.layers.quantization.base import QuantizationConfig
from tokenmill.model.blocks import DecoderForCausalLM, DecoderSpec
from tokenmill.model.gguf_arch import GGUFArch, GGUFConfig, GGUFMeta
from tokenmill.model.hf_config import hf_get
from tokenmill.model.llama import llama_spec
from tokenmill.model.moe_block import MoESpec
from tokenmill.model.registry import register_gguf, register_model
from tokenmill.model.weights import WeightNaming


@dataclass(frozen=True)
class MixtralNaming(WeightNaming):
    def param_name(self, name: str, tied: bool) -> str | None:
        name = super().param_name(name, tied)
        return None if name is None else name.replace(".block_sparse_moe.", ".mlp.")


def dense_layers(cfg) -> set[int]:
    """Layers with the dense MLP, as transformers' Qwen MoE decoder layers decide it."""
    step = int(hf_get(cfg, "decoder_sparse_step", 1) or 1)
    only = set(hf_get(cfg, "mlp_only_layers") or ())
    return {i for i in range(cfg.num_hidden_layers) if i in only or (i + 1) % step != 0}


def moe_spec(cfg) -> DecoderSpec:
    spec = llama_spec(cfg)
    mt = cfg.model_type
    if mt == "mixtral":
        moe = MoESpec(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size, True, cfg.hidden_act)
        return replace(spec, moe=moe)
    attention = spec.attention
    if mt == "qwen2_moe":
        attention = replace(attention, qkv_bias=bool(hf_get(cfg, "qkv_bias", True)), o_bias=False)
    elif mt == "qwen3_moe":
        attention = replace(attention, qk_norm=True)
    moe = MoESpec(cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                  bool(hf_get(cfg, "norm_topk_prob", False)), cfg.hidden_act,
                  int(hf_get(cfg, "shared_expert_intermediate_size", 0) or 0) if mt == "qwen2_moe" else 0)
    dense = dense_layers(cfg) if cfg.num_experts > 0 else set(range(cfg.num_hidden_layers))
    layers = tuple(replace(layer, dense_mlp=i in dense) for i, layer in enumerate(spec.layers))
    return replace(spec, attention=attention, moe=moe, layers=layers)


@register_model("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
class MoEForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg, dtype: torch.dtype, compute_dtype: torch.dtype, max_positions: int,
                 quant_config: QuantizationConfig | None = None, tp_rank: int = 0, tp_size: int = 1,
                 expert_parallel: bool = False, pp_rank: int = 0, pp_size: int = 1) -> None:
        super().__init__(cfg, moe_spec(cfg), dtype, compute_dtype, max_positions, quant_config, tp_rank, tp_size,
                         expert_parallel, pp_rank, pp_size)


@register_model("MixtralForCausalLM")
class MixtralForCausalLM(MoEForCausalLM):
    weight_naming = MixtralNaming()


def qwen_moe_gguf_config(m: GGUFMeta, generic: GGUFConfig) -> GGUFConfig:
    """Qwen MoE hyper-parameters from `<arch>.expert_*` (none for a dense file). Every layer is sparse (llama.cpp
    has no dense-layer list); top-k renormalisation is llama.cpp's default for the architecture (on for
    qwen3moe, off for qwen2moe) unless the file says (`expert_weights_norm`). (Mixtral: llama.py's `llama`.)"""
    experts = m.expert_count()
    if experts == 0:
        return generic
    return generic.updated(num_experts=experts, num_experts_per_tok=int(m("expert_used_count")), decoder_sparse_step=1,
                           mlp_only_layers=[], moe_intermediate_size=int(m("expert_feed_forward_length")),
                           norm_topk_prob=bool(m("expert_weights_norm", m.arch == "qwen3moe")))


def qwen2moe_gguf_config(m: GGUFMeta, generic: GGUFConfig) -> GGUFConfig:
    """The Qwen MoE keys, plus the shared expert's size and q/k/v bias."""
    config = qwen_moe_gguf_config(m, generic)
    if m.expert_count() == 0:
        return config
    return config.updated(shared_expert_intermediate_size=int(m("expert_shared_feed_forward_length", 0) or 0),
                          qkv_bias="blk.0.attn_q.bias" in m.tensors)


register_gguf(GGUFArch("qwen2moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", config=qwen2moe_gguf_config))
register_gguf(GGUFArch("qwen3moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", config=qwen_moe_gguf_config))
