"""The Llama family: Llama 2/3, Mistral (sliding window), Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm)."""
from __future__ import annotations

import torch

from tokenmill.layers.quantization.base import QuantizationConfig
from tokenmill.model.blocks import AttentionSpec, DecoderForCausalLM, DecoderSpec, LayerSpec, MLPSpec
from tokenmill.model.gguf_arch import GGUFArch, GGUFConfig, GGUFMeta
from tokenmill.model.hf_config import hf_get
from tokenmill.model.registry import register_gguf, register_model

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


@register_model("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
class LlamaForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg, dtype: torch.dtype, compute_dtype: torch.dtype, max_positions: int,
                 quant_config: QuantizationConfig | None = None, tp_rank: int = 0, tp_size: int = 1,
                 expert_parallel: bool = False, pp_rank: int = 0, pp_size: int = 1) -> None:
        super().__init__(cfg, llama_spec(cfg), dtype, compute_dtype, max_positions, quant_config, tp_rank, tp_size,
                         expert_parallel, pp_rank, pp_size)


def llama_gguf_config(m: GGUFMeta, generic: GGUFConfig) -> GGUFConfig:
    """llama.cpp writes Mixtral as `llama` with an expert count (every layer sparse, top-k renormalised)."""
    if m.expert_count() == 0:
        return generic
    kwargs = dict(generic.kwargs, num_local_experts=m.expert_count(), num_experts_per_tok=int(m("expert_used_count")))
    return GGUFConfig("MixtralConfig", "MixtralForCausalLM", kwargs)


# llama.cpp permutes Llama's and Mistral's Q/K rows for its rope layout (converter: LlamaModel), not Qwen's
register_gguf(GGUFArch("llama", "LlamaConfig", "LlamaForCausalLM", permuted_qk=True, config=llama_gguf_config))
register_gguf(GGUFArch("mistral", "MistralConfig", "MistralForCausalLM", permuted_qk=True))
register_gguf(GGUFArch("qwen2", "Qwen2Config", "Qwen2ForCausalLM"))
register_gguf(GGUFArch("qwen3", "Qwen3Config", "Qwen3ForCausalLM"))
