"""Phi-3 / Phi-4 (transformers' Phi3ForCausalLM): the Llama decoder with fused checkpoint tensors.

The checkpoint stores q/k/v as one `self_attn.qkv_proj` tensor (q rows, then k, then v) and gate/up
as one `mlp.gate_up_proj` (gate rows, then up): the same layouts as the packed layers, whose loaders
split a whole tensor into this rank's shards; so nothing is unpacked (`packed_modules_mapping` empty).
LongRoPE (`rope_type: longrope`, Phi-3 128k / Phi-3.5) is served up to `original_max_position_embeddings`
with its short factors and attention factor, as transformers computes it there; a longer max_model_len is
refused at load with a ValueError naming the setting. Partial rotary (`partial_rotary_factor`, Phi-4-mini's
0.75) rotates the first features of each head only.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from tokenmill.layers.quantization.base import QuantizationConfig
from tokenmill.model.blocks import DecoderForCausalLM, DecoderSpec
from tokenmill.model.gguf_arch import GGUFArch, GGUFConfig, GGUFMeta, head_dim_of, partial_rope_kwargs
from tokenmill.model.hf_config import hf_get
from tokenmill.model.llama import llama_spec
from tokenmill.model.registry import register_gguf, register_model


def phi3_spec(cfg, max_positions: int) -> DecoderSpec:
    rope = hf_get(cfg, "rope_parameters") or hf_get(cfg, "rope_scaling") or {}  # rope_scaling: transformers 4.x
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "longrope":
        # transformers rotates with the short factors while a sequence is within original_max_position_embeddings
        # and, once it passes that, recomputes the whole sequence with the long factors: a paged KV cache cannot
        # rotate its past keys again, so only contexts that never pass it are served (short factors throughout).
        original = int(rope.get("original_max_position_embeddings")
                       or hf_get(cfg, "original_max_position_embeddings") or 0)
        if max_positions > original:
            raise ValueError(
                f"Phi-3 rope_type 'longrope' (rope_parameters in config.json) is supported only up to its "
                f"original_max_position_embeddings ({original}), where the short factors apply; max_model_len is "
                f"{max_positions}: pass --max-model-len {original} or less")
    elif rope_type != "default":
        raise ValueError(f"Phi-3 rope scaling rope_type={rope_type!r} (rope_parameters in config.json) is not "
                         "supported by tokenmill; only plain rotary ('default') and 'longrope' are")
    spec = llama_spec(cfg)
    # Phi-4-mini rotates 3/4 of each head (transformers' int(head_dim * factor)); the rest passes through.
    partial = float(rope.get("partial_rotary_factor", hf_get(cfg, "partial_rotary_factor", 1.0)) or 1.0)
    rotary_dim = int(spec.attention.head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= spec.attention.head_dim:
        raise ValueError(f"Phi-3 partial_rotary_factor={partial} gives {rotary_dim} rotary features of a "
                         f"{spec.attention.head_dim}-wide head: it must be an even number up to the head size")
    if rotary_dim == spec.attention.head_dim:
        return spec
    return replace(spec, attention=replace(spec.attention, rotary_dim=rotary_dim))


@register_model("Phi3ForCausalLM")
class Phi3ForCausalLM(DecoderForCausalLM):
    packed_modules_mapping: dict[str, list[str]] = {}  # the checkpoint's qkv_proj and gate_up_proj are packed

    def __init__(self, cfg, dtype: torch.dtype, compute_dtype: torch.dtype, max_positions: int,
                 quant_config: QuantizationConfig | None = None, tp_rank: int = 0, tp_size: int = 1,
                 expert_parallel: bool = False, pp_rank: int = 0, pp_size: int = 1) -> None:
        super().__init__(cfg, phi3_spec(cfg, max_positions), dtype, compute_dtype, max_positions, quant_config, tp_rank, tp_size,
                         expert_parallel, pp_rank, pp_size)


def phi3_gguf_config(m: GGUFMeta, generic: GGUFConfig) -> GGUFConfig:
    """Partial rotary from rope.dimension_count (all of the head when absent), and LongRoPE when the file has
    its factor tensors."""
    longrope = "rope_factors_long.weight" in m.tensors or "rope_factors_short.weight" in m.tensors
    extra = _phi3_longrope(m) if longrope else None
    return generic.updated(**partial_rope_kwargs(m, generic.kwargs, head_dim_of(generic.kwargs), extra))


def _phi3_longrope(m: GGUFMeta) -> dict:
    """Phi-3 128k / Phi-3.5 / Phi-4-mini: llama.cpp's converter writes LongRoPE as two F32 tensors of rope_dim / 2
    factors, the original context length and the attention factor it computed as transformers does."""
    import gguf

    missing = [n for n in ("rope_factors_long.weight", "rope_factors_short.weight") if n not in m.tensors]
    original = m("rope.scaling.original_context_length")
    if missing or not original:
        raise ValueError(f"GGUF architecture {m.arch!r}: LongRoPE needs rope_factors_long, rope_factors_short and "
                         f"{m.arch}.rope.scaling.original_context_length; missing "
                         f"{', '.join(missing) or f'{m.arch}.rope.scaling.original_context_length'}")
    factors = {}
    for name in ("long", "short"):
        t = m.tensors[f"rope_factors_{name}.weight"]
        factors[f"{name}_factor"] = [float(x) for x in gguf.quants.dequantize(
            m.reader.raw(t), gguf.GGMLQuantizationType(t.ggml_type)).reshape(-1)]
    out = dict(rope_type="longrope", original_max_position_embeddings=int(original), **factors)
    if m("rope.scaling.attn_factor") is not None:
        out["attention_factor"] = float(m("rope.scaling.attn_factor"))
    return out


# llama.cpp's fused attn_qkv and ffn_up (gate and up) are the checkpoint's fused tensors
register_gguf(GGUFArch("phi3", "Phi3Config", "Phi3ForCausalLM", partial_rope=True, longrope=True,
                       config=phi3_gguf_config,
                       extra_parts={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}))
