"""The Llama family: Llama 2/3, Mistral (sliding window), Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm)."""
from __future__ import annotations

import torch

from tokenmill.layers.quantization.base import QuantizationConfig
from tokenmill.model.blocks import AttentionSpec, DecoderForCausalLM, DecoderSpec, LayerSpec, MLPSpec
from tokenmill.model.hf_config import hf_get

# What a family fixes whatever its config says (Qwen2's config has no attention_bias).
FAMILY_FLAGS: dict[str, dict[str, bool]] = {
    "qwen2": {"qkv_bias": True, "o_bias": False},
    "qwen3": {"qk_norm": True},
}


def layer_windows(cfg) -> list[int | None]:
    """Sliding window of each layer (None: full attention), as transformers decides it."""
    n = cfg.num_hidden_layers
    window = hf_get(cfg, "sliding_window")
    layer_types = hf_get(cfg, "layer_types")
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    return [window] * n


def llama_spec(cfg) -> DecoderSpec:
    heads = cfg.num_attention_heads
    head_dim = hf_get(cfg, "head_dim") or cfg.hidden_size // heads
    bias = bool(hf_get(cfg, "attention_bias", False))
    flags = {"qkv_bias": bias, "o_bias": bias, **FAMILY_FLAGS.get(cfg.model_type, {})}
    return DecoderSpec(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        rms_norm_eps=cfg.rms_norm_eps,
        attention=AttentionSpec(heads, hf_get(cfg, "num_key_value_heads") or heads, head_dim,
                                head_dim**-0.5, **flags),
        mlp=MLPSpec(cfg.intermediate_size, hf_get(cfg, "hidden_act", "silu"), bool(hf_get(cfg, "mlp_bias", False))),
        layers=tuple(LayerSpec(sliding_window=w) for w in layer_windows(cfg)),
        tie_word_embeddings=bool(hf_get(cfg, "tie_word_embeddings", False)),
    )


class LlamaForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg, dtype: torch.dtype, compute_dtype: torch.dtype, max_positions: int,
                 quant_config: QuantizationConfig | None = None, tp_rank: int = 0, tp_size: int = 1,
                 expert_parallel: bool = False, pp_rank: int = 0, pp_size: int = 1) -> None:
        super().__init__(cfg, llama_spec(cfg), dtype, compute_dtype, max_positions, quant_config, tp_rank, tp_size,
                         expert_parallel, pp_rank, pp_size)
