"""Phi-3 / Phi-4 (transformers' Phi3ForCausalLM): the Llama decoder with fused checkpoint tensors.

The checkpoint stores q/k/v as one `self_attn.qkv_proj` tensor (q rows, then k, then v) and gate/up
as one `mlp.gate_up_proj` (gate rows, then up): the same layouts as the packed layers, whose loaders
split a whole tensor into this rank's shards; so nothing is unpacked (`packed_modules_mapping` empty).
Refused at load, naming the setting: LongRoPE scaling (`rope_type: longrope`, which switches between
short and long factors by context length) and partial rotary (`partial_rotary_factor` < 1).
"""
from __future__ import annotations

import torch

from tokenmill.layers.quantization.base import QuantizationConfig
from tokenmill.model.blocks import DecoderForCausalLM, DecoderSpec
from tokenmill.model.hf_config import hf_get
from tokenmill.model.llama import llama_spec


def phi3_spec(cfg) -> DecoderSpec:
    rope = hf_get(cfg, "rope_parameters") or hf_get(cfg, "rope_scaling") or {}  # rope_scaling: transformers 4.x
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"Phi-3 rope scaling rope_type={rope_type!r} (rope_parameters in config.json) is not "
                         "supported by tokenmill; only plain rotary (rope_type 'default') is")
    partial = float(rope.get("partial_rotary_factor", hf_get(cfg, "partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0:
        raise ValueError(f"Phi-3 partial_rotary_factor={partial} is not supported by tokenmill; "
                         "only full rotary (1.0) is")
    return llama_spec(cfg)


class Phi3ForCausalLM(DecoderForCausalLM):
    packed_modules_mapping: dict[str, list[str]] = {}  # the checkpoint's qkv_proj and gate_up_proj are packed

    def __init__(self, cfg, dtype: torch.dtype, compute_dtype: torch.dtype, max_positions: int,
                 quant_config: QuantizationConfig | None = None, tp_rank: int = 0, tp_size: int = 1,
                 expert_parallel: bool = False, pp_rank: int = 0, pp_size: int = 1) -> None:
        super().__init__(cfg, phi3_spec(cfg), dtype, compute_dtype, max_positions, quant_config, tp_rank, tp_size,
                         expert_parallel, pp_rank, pp_size)
