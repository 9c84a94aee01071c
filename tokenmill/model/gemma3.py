"""Gemma 3, text only (transformers' Gemma3ForCausalLM, config model_type "gemma3_text").

Differences from Llama: the embedding is scaled by sqrt(hidden_size); every RMSNorm scales by
(1 + weight); q and k are RMSNorm'd per head; each layer has a norm after attention and around
the MLP as well (four in all); the MLP is GELU-tanh gated; the attention scale comes from
query_pre_attn_scalar; and layers alternate between sliding-window attention with a local rope and
full attention with the global (possibly scaled) rope, as config.layer_types says.
Norm weights load as transformers' zero-centred w (the model computes 1 + w); the GGUF reader
subtracts the 1 llama.cpp adds.
"""
from __future__ import annotations

import torch

from tokenmill.layers.quantization.base import QuantizationConfig
from tokenmill.model.blocks import AttentionSpec, DecoderForCausalLM, DecoderSpec, LayerSpec, MLPSpec
from tokenmill.model.hf_config import hf_get
from tokenmill.model.gguf_arch import GGUFArch, GGUFConfig, GGUFMeta
from tokenmill.model.registry import register_gguf, register_model

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(cfg) -> list[str]:
    types = hf_get(cfg, "layer_types")
    if types is None:  # Gemma3TextConfig fills this in; default pattern is 5 sliding then 1 full
        types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(cfg.num_hidden_layers)]
    unknown = set(types) - {SLIDING, FULL}
    if unknown:
        raise ValueError(f"unsupported Gemma 3 layer types {sorted(unknown)}")
    return list(types)


def gemma3_spec(cfg, dtype: torch.dtype) -> DecoderSpec:
    if hf_get(cfg, "attn_logit_softcapping") is not None:
        raise NotImplementedError(
            f"attn_logit_softcapping={cfg.attn_logit_softcapping} is set in config.json, but tokenmill's "
            "attention backend has no logit soft-capping (Gemma 3 checkpoints leave it null)"
        )
    if hf_get(cfg, "use_bidirectional_attention", False):
        raise NotImplementedError("use_bidirectional_attention=True (an encoder-style Gemma 3) is not supported")
    bias = bool(hf_get(cfg, "attention_bias", False))
    # Sliding layers use the local rope (theta 10k), full layers the global one (theta 1M, plus e.g.
    # linear scaling on the larger models): the rope key is the layer type.
    layers = tuple(LayerSpec(cfg.sliding_window if t == SLIDING else None, rope=t) for t in layer_types(cfg))
    return DecoderSpec(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        rms_norm_eps=cfg.rms_norm_eps,
        # Scale from query_pre_attn_scalar, not head_dim: they differ for Gemma 3 27B.
        attention=AttentionSpec(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                cfg.query_pre_attn_scalar**-0.5, qkv_bias=bias, o_bias=bias, qk_norm=True),
        mlp=MLPSpec(cfg.intermediate_size, hf_get(cfg, "hidden_activation") or "gelu_pytorch_tanh"),
        layers=layers,
        norm_offset=1.0,
        sandwich_norms=True,
        # transformers multiplies by sqrt(hidden_size) cast to the weights' dtype (55.4256 -> 55.5 in
        # bfloat16); rounding to the storage dtype matches it for a checkpoint loaded in that dtype.
        embed_scale=float(torch.tensor(cfg.hidden_size**0.5, dtype=dtype)),
        tie_word_embeddings=bool(hf_get(cfg, "tie_word_embeddings", True)),
        final_logit_softcapping=hf_get(cfg, "final_logit_softcapping"),
    )


@register_model("Gemma3ForCausalLM")
class Gemma3ForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg, dtype: torch.dtype, compute_dtype: torch.dtype, max_positions: int,
                 quant_config: QuantizationConfig | None = None, tp_rank: int = 0, tp_size: int = 1,
                 expert_parallel: bool = False, pp_rank: int = 0, pp_size: int = 1) -> None:
        super().__init__(cfg, gemma3_spec(cfg, dtype), dtype, compute_dtype, max_positions, quant_config,
                         tp_rank, tp_size, expert_parallel, pp_rank, pp_size)


def gemma3_gguf_config(m: GGUFMeta, generic: GGUFConfig) -> GGUFConfig:
    """Gemma 3's GGUF keys: the file's rope is the full layers' (the sliding layers' local rope is fixed), the
    attention scale's scalar is the head size, the window 512 when the file has none."""
    kw = generic.kwargs
    return generic.updated(
        sliding_window=int(m("attention.sliding_window", 512)),
        query_pre_attn_scalar=int(kw.get("head_dim") or kw["hidden_size"] // kw["num_attention_heads"]),
        rope_parameters={FULL: kw["rope_parameters"], SLIDING: {"rope_type": "default", "rope_theta": 10000.0}},
        hidden_activation="gelu_pytorch_tanh")


register_gguf(GGUFArch("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", norm_plus_one=True,
                       config=gemma3_gguf_config))
