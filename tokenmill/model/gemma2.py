"""Gemma 2 (transformers' Gemma2ForCausalLM): Gemma 3's decoder (gemma3.py) without q/k norms, with
attention logit soft-capping (`attn_logit_softcapping`, in every attention backend) and one rope for
both layer types.

As in Gemma 3: embeddings scaled by sqrt(hidden_size) in the weights' dtype, (1 + w) RMSNorms, four
norms a layer (sandwich), GELU-tanh gated MLP, the attention scale from `query_pre_attn_scalar`,
sliding-window and full layers alternating as `layer_types` says, and the final logit soft-cap.
"""
from __future__ import annotations

import torch

from tokenmill.layers.quantization.base import QuantizationConfig
from tokenmill.model.blocks import AttentionSpec, DecoderForCausalLM, DecoderSpec, LayerSpec, MLPSpec
from tokenmill.model.gemma3 import SLIDING, layer_types
from tokenmill.model.hf_config import hf_get
from tokenmill.model.gguf_arch import GGUFArch, GGUFConfig, GGUFMeta, head_dim_of
from tokenmill.model.registry import register_gguf, register_model


def gemma2_spec(cfg, dtype: torch.dtype) -> DecoderSpec:
    bias = bool(hf_get(cfg, "attention_bias", False))
    cap = hf_get(cfg, "attn_logit_softcapping")
    return DecoderSpec(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        rms_norm_eps=cfg.rms_norm_eps,
        attention=AttentionSpec(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                cfg.query_pre_attn_scalar**-0.5, qkv_bias=bias, o_bias=bias,
                                logits_soft_cap=None if cap is None else float(cap)),
        mlp=MLPSpec(cfg.intermediate_size, hf_get(cfg, "hidden_activation") or "gelu_pytorch_tanh"),
        layers=tuple(LayerSpec(cfg.sliding_window if t == SLIDING else None) for t in layer_types(cfg)),
        norm_offset=1.0,
        sandwich_norms=True,
        embed_scale=float(torch.tensor(cfg.hidden_size**0.5, dtype=dtype)),  # as transformers rounds it
        tie_word_embeddings=bool(hf_get(cfg, "tie_word_embeddings", True)),
        final_logit_softcapping=hf_get(cfg, "final_logit_softcapping"),
    )


@register_model("Gemma2ForCausalLM")
class Gemma2ForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg, dtype: torch.dtype, compute_dtype: torch.dtype, max_positions: int,
                 quant_config: QuantizationConfig | None = None, tp_rank: int = 0, tp_size: int = 1,
                 expert_parallel: bool = False, pp_rank: int = 0, pp_size: int = 1) -> None:
        super().__init__(cfg, gemma2_spec(cfg, dtype), dtype, compute_dtype, max_positions, quant_config,
                         tp_rank, tp_size, expert_parallel, pp_rank, pp_size)


def gemma2_gguf_config(m: GGUFMeta, generic: GGUFConfig) -> GGUFConfig:
    """Gemma 2's GGUF keys (as llama.cpp's convert_hf_to_gguf.py writes them)."""
    kw = generic.kwargs
    head_dim = head_dim_of(kw)
    # llama.cpp's gemma2 scales queries by 1/sqrt(head_dim), but by 1/sqrt(hidden / heads) for the 27B
    # (46 layers), which is what that checkpoint's query_pre_attn_scalar says; the file has no key for it
    scalar = kw["hidden_size"] // kw["num_attention_heads"] if kw["num_hidden_layers"] == 46 else head_dim
    out = dict(head_dim=head_dim, query_pre_attn_scalar=int(scalar),
               hidden_activation="gelu_pytorch_tanh", sliding_window=int(m("attention.sliding_window", 4096)))
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if m(key) is not None:
            out[key] = float(m(key))
    return generic.updated(**out)


register_gguf(GGUFArch("gemma2", "Gemma2Config", "Gemma2ForCausalLM", norm_plus_one=True,
                       config=gemma2_gguf_config))
