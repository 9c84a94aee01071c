"""DeepSeek-V2 / V2-Lite / V3 (transformers' DeepseekV2ForCausalLM, DeepseekV3ForCausalLM).

The Llama decoder (pre-norm RMSNorms, residual stream) with two different blocks:
- Multi-head Latent Attention (layers/mla.py) over a compressed latent KV cache: kv_lora_rank + qk_rope_head_dim
  values per token and layer. Rotary on the qk_rope_head_dim features only, in DeepSeek's interleaved pairs (V2
  always; V3 unless `rope_interleave` is false); YaRN's mscale folded into the softmax scale
  (rotary.yarn_softmax_scale).
- DeepSeekMoE (model/deepseek_moe.py) on layers from `first_k_dense_replace` on (every `moe_layer_freq`-th, as
  DeepSeek's own code; the released models use 1); the first layers have the dense MLP of `intermediate_size`.
  V2 scores with softmax (`topk_method` greedy or group_limited_greedy), V3 with sigmoid and the correction bias
  (noaux_tc).

Checkpoint names are transformers' (the same as DeepSeek's own): self_attn.{q_proj | q_a_proj, q_a_layernorm,
q_b_proj}, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; mlp.{gate_proj, up_proj, down_proj} (dense),
mlp.gate.weight (+ e_score_correction_bias), mlp.experts.{e}.*_proj, mlp.shared_experts.*_proj. The MTP layer
(`num_nextn_predict_layers`, stored as layer num_hidden_layers) is skipped here; the `mtp` speculative method loads
it as a draft head whose block is this module's layer class (spec_decode/heads.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.layers.mla import MLASpec, MLAttention
from tokenmill.layers.mla_up import MLAStep, mode
from tokenmill.layers.quantization.base import QuantizationConfig
from tokenmill.layers.rotary import RotaryEmbedding, yarn_softmax_scale
from tokenmill.model.blocks import (AttentionSpec, Build, DecoderForCausalLM, DecoderSpec, LayerSpec, MLPBlock,
                                    MLPSpec)
from tokenmill.model.deepseek_moe import DeepseekMoEBlock, RouterSpec
from tokenmill.model.hf_config import hf_get
from tokenmill.model.moe_block import MoESpec
from tokenmill.model.registry import register_model


@dataclass(frozen=True)
class DeepseekSpec(DecoderSpec):
    mla: MLASpec | None = None
    router: RouterSpec | None = None


def moe_layers(cfg) -> set[int]:
    """Layers with DeepSeekMoE: from first_k_dense_replace on, every moe_layer_freq-th."""
    if not hf_get(cfg, "n_routed_experts"):
        return set()
    first = int(hf_get(cfg, "first_k_dense_replace", 0) or 0)
    freq = int(hf_get(cfg, "moe_layer_freq", 1) or 1)
    return {i for i in range(cfg.num_hidden_layers) if i >= first and i % freq == 0}


def deepseek_spec(cfg) -> DeepseekSpec:
    v3 = cfg.model_type == "deepseek_v3"
    mla = MLASpec(hf_get(cfg, "q_lora_rank"), cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                  cfg.v_head_dim, bool(hf_get(cfg, "attention_bias", False)))
    scale = yarn_softmax_scale(cfg, (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5)
    interleaved = bool(hf_get(cfg, "rope_interleave", True)) if v3 else True  # V2 rotates complex pairs
    # The attention spec describes the cache: one KV head of the latent width; rotary on the rope features.
    attention = AttentionSpec(cfg.num_attention_heads, 1, mla.latent_dim, scale, rotary_dim=cfg.qk_rope_head_dim,
                              rotary_interleaved=interleaved)
    act = hf_get(cfg, "hidden_act", "silu")
    n_shared = int(hf_get(cfg, "n_shared_experts", 0) or 0)
    experts = int(hf_get(cfg, "n_routed_experts", 0) or 0)
    moe = router = None
    if experts:
        # V2 and V3 both renormalise under norm_topk_prob, as vLLM does (transformers' V2 router ignores it, and
        # DeepSeek's own V2 code then skips routed_scaling_factor; every released V2 config has it false).
        moe = MoESpec(experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                      bool(hf_get(cfg, "norm_topk_prob", False)), act, cfg.moe_intermediate_size * n_shared)
        method = "noaux_tc" if v3 else (hf_get(cfg, "topk_method", "greedy") or "greedy")
        router = RouterSpec("sigmoid" if v3 else "softmax", method, int(hf_get(cfg, "n_group", 1) or 1),
                            int(hf_get(cfg, "topk_group", 1) or 1),
                            float(hf_get(cfg, "routed_scaling_factor", 1.0) or 1.0), v3)
    sparse = moe_layers(cfg)
    return DeepseekSpec(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        rms_norm_eps=cfg.rms_norm_eps,
        attention=attention,
        mlp=MLPSpec(cfg.intermediate_size, act, bool(hf_get(cfg, "mlp_bias", False))),
        layers=tuple(LayerSpec(dense_mlp=i not in sparse) for i in range(cfg.num_hidden_layers)),
        tie_word_embeddings=bool(hf_get(cfg, "tie_word_embeddings", False)),
        moe=moe,
        mla=mla,
        router=router,
    )


class DeepseekDecoderLayer(nn.Module):
    """Pre-norm layer: MLA, then the dense MLP or DeepSeekMoE (DecoderLayer's forward contract)."""

    def __init__(self, spec: DeepseekSpec, layer: LayerSpec, rotary: RotaryEmbedding, build: Build,
                 prefix: str) -> None:
        super().__init__()
        h = spec.hidden_size
        self.input_layernorm = build.norm(h, spec)
        self.self_attn = MLAttention(h, spec.attention.num_heads, spec.mla, spec.attention.scale, rotary, build,
                                     f"{prefix}.self_attn")
        self.post_attention_layernorm = build.norm(h, spec)
        if spec.moe is not None and not layer.dense_mlp:
            self.mlp = DeepseekMoEBlock(h, spec.moe, spec.router, build, f"{prefix}.mlp")
        else:
            self.mlp = MLPBlock(spec, build, f"{prefix}.mlp")

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            residual, x = self.input_layernorm.add(residual, x)
        residual, x = self.post_attention_layernorm.add(residual, self.self_attn(positions, x, meta))
        return self.mlp(x), residual


@register_model("DeepseekV2ForCausalLM")
class DeepseekV2ForCausalLM(DecoderForCausalLM):
    # q/k/v are not packed (MLA); the dense MLP's and shared experts' gate and up are
    packed_modules_mapping: dict[str, list[str]] = {"gate_up_proj": ["gate_proj", "up_proj"]}
    decoder_layer = DeepseekDecoderLayer

    def __init__(self, cfg, dtype: torch.dtype, compute_dtype: torch.dtype, max_positions: int,
                 quant_config: QuantizationConfig | None = None, tp_rank: int = 0, tp_size: int = 1,
                 expert_parallel: bool = False, pp_rank: int = 0, pp_size: int = 1) -> None:
        spec = deepseek_spec(cfg)
        super().__init__(cfg, spec, dtype, compute_dtype, max_positions, quant_config, tp_rank,
                         tp_size, expert_parallel, pp_rank, pp_size)
        self.mla_step = MLAStep(spec.mla, mode=mode())  # absorbed or up-projected, per step (layers/mla_up.py)
        for layer in self.own_layers:
            layer.self_attn.step = self.mla_step

    def begin_step(self, layout) -> None:
        self.mla_step.set(layout)


@register_model("DeepseekV3ForCausalLM")
class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass
