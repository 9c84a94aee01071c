"""DeepSeek-V2 / V3 GGUF files (llama.cpp's `deepseek2` architecture): the transformers config from its metadata
keys and its tensor names, as llama.cpp's convert_hf_to_gguf.py writes them.

What the converter does that a loader has to undo:
- MLA is written as MQA: `head_count_kv` 1. Newer files say `attention.key_length` = kv_lora_rank +
  qk_rope_head_dim and `value_length` = kv_lora_rank (the latent) and give the per-head sizes in
  `attention.key_length_mla` / `value_length_mla`; older files have only key_length = qk_nope + qk_rope and
  value_length = v_head_dim.
- kv_b_proj [heads * (qk_nope + v), kv_lora_rank]: older files keep it whole (`attn_kv_b`); newer ones split it per
  head into `attn_k_b` [heads, kv_lora_rank, qk_nope] (transposed, for the absorbed product) and `attn_v_b`
  [heads, v, kv_lora_rank]. Both are handled (the installed gguf package defines all three names); the halves
  are joined back into kv_b_proj at load (KvBJoiner).
- Experts merged per layer ([E, out, in]), shared experts as `*_shexp`, V3's correction bias as
  `exp_probs_b.bias`. No rows are permuted: llama.cpp rotates DeepSeek's rope features in adjacent pairs, as
  transformers does with rope_interleave.
- V3 vs V2: `expert_gating_func` sigmoid (or an exp_probs_b tensor) means V3's noaux_tc router; softmax (or no
  key: llama.cpp's default for the architecture) V2's, group-limited when `expert_group_count` > 1.
- YaRN: `rope.scaling.yarn_log_multiplier` is 0.1 * mscale_all_dim. llama.cpp's deepseek2 graph cancels YaRN's
  cos/sin temperature and multiplies the softmax scale by mscale(factor, mscale_all_dim)^2, which is
  transformers' rope with mscale == mscale_all_dim (as every released config has).
"""
from __future__ import annotations

import numpy as np

from tokenmill.model.gguf_arch import GGUFArch, GGUFConfig, GGUFMeta, TensorJoiner
from tokenmill.model.registry import register_gguf

# GGUF block part (gguf.constants.MODEL_TENSOR member) -> transformers part of a DeepSeek layer
_PARTS = {
    "ATTN_NORM": "input_layernorm.weight",
    "ATTN_Q": "self_attn.q_proj.weight",  # V2-Lite: no q low-rank pair
    "ATTN_Q_A": "self_attn.q_a_proj.weight",
    "ATTN_Q_A_NORM": "self_attn.q_a_layernorm.weight",
    "ATTN_Q_B": "self_attn.q_b_proj.weight",
    "ATTN_KV_A_MQA": "self_attn.kv_a_proj_with_mqa.weight",
    "ATTN_KV_A_NORM": "self_attn.kv_a_layernorm.weight",
    "ATTN_KV_B": "self_attn.kv_b_proj.weight",
    "ATTN_K_B": "self_attn.kv_b_proj.weight",  # joined with ATTN_V_B at load
    "ATTN_V_B": "self_attn.kv_b_proj.weight",
    "ATTN_OUT": "self_attn.o_proj.weight",
    "FFN_NORM": "post_attention_layernorm.weight",
    "FFN_GATE": "mlp.gate_proj.weight",
    "FFN_UP": "mlp.up_proj.weight",
    "FFN_DOWN": "mlp.down_proj.weight",
    "FFN_GATE_INP": "mlp.gate.weight",
    "FFN_GATE_EXP": "mlp.experts.gate_proj.weight",  # merged [E, ...]
    "FFN_UP_EXP": "mlp.experts.up_proj.weight",
    "FFN_DOWN_EXP": "mlp.experts.down_proj.weight",
    "FFN_GATE_SHEXP": "mlp.shared_experts.gate_proj.weight",
    "FFN_UP_SHEXP": "mlp.shared_experts.up_proj.weight",
    "FFN_DOWN_SHEXP": "mlp.shared_experts.down_proj.weight",
    "FFN_EXP_PROBS_B": "mlp.gate.e_score_correction_bias",
}
# The file's suffix for a part (llama.cpp loads the correction bias as "<name>.bias")
_SUFFIX = {"FFN_EXP_PROBS_B": "bias"}
SPLIT_KV_B = ("ATTN_K_B", "ATTN_V_B")


def deepseek2_tensor_names(num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> transformers name, from gguf.constants' deepseek2 tensors (parts the installed package
    does not define for the architecture are left out)."""
    import gguf

    defined = set(gguf.MODEL_TENSORS[gguf.MODEL_ARCH.DEEPSEEK2])
    T, names = gguf.MODEL_TENSOR, gguf.TENSOR_NAMES
    out = {f"{names[T.TOKEN_EMBD]}.weight": "model.embed_tokens.weight",
           f"{names[T.OUTPUT_NORM]}.weight": "model.norm.weight",
           f"{names[T.OUTPUT]}.weight": "lm_head.weight"}
    for part, hf in _PARTS.items():
        member = getattr(T, part, None)
        if member is None or member not in defined:
            continue
        for i in range(num_layers):
            out[f"{names[member].format(bid=i)}.{_SUFFIX.get(part, 'weight')}"] = f"model.layers.{i}.{hf}"
    return out


def split_kv_b_part(gguf_name: str) -> str | None:
    """"k" or "v" for a layer's attn_k_b / attn_v_b tensor, else None."""
    import gguf

    for part in SPLIT_KV_B:
        member = getattr(gguf.MODEL_TENSOR, part, None)
        if member is not None:
            stem = gguf.TENSOR_NAMES[member].split(".")[-1]  # "attn_k_b"
            if gguf_name.endswith(f".{stem}.weight"):
                return part[-3].lower()
    return None


class KvBJoiner(TensorJoiner):
    """Collects a layer's attn_k_b [H, kv_lora, qk_nope] and attn_v_b [H, v, kv_lora] (float arrays, shaped
    as the file says) and gives back kv_b_proj [H * (qk_nope + v), kv_lora] once it has both."""

    def __init__(self) -> None:
        self.pending: dict[tuple[str, str], np.ndarray] = {}

    def add(self, gguf_name: str, hf: str, w: np.ndarray) -> list[tuple[str, np.ndarray]]:
        part = split_kv_b_part(gguf_name)
        if part is None:
            return [(hf, w)]
        joined = self.join(gguf_name, part, w)
        return [] if joined is None else [(hf, joined)]

    def join(self, gguf_name: str, part: str, w: np.ndarray) -> np.ndarray | None:
        layer = gguf_name.rsplit(".", 2)[0]  # blk.N
        self.pending[(layer, part)] = w
        k, v = self.pending.get((layer, "k")), self.pending.get((layer, "v"))
        if k is None or v is None:
            return None
        del self.pending[(layer, "k")], self.pending[(layer, "v")]
        if k.ndim != 3 or v.ndim != 3 or k.shape[0] != v.shape[0] or k.shape[1] != v.shape[2]:
            raise ValueError(f"GGUF {layer}: attn_k_b {tuple(k.shape)} and attn_v_b {tuple(v.shape)} are not "
                             "[heads, kv_lora_rank, qk_nope] and [heads, v_head_dim, kv_lora_rank]")
        kv = np.concatenate([k.transpose(0, 2, 1), v], axis=1)  # [H, qk_nope + v, kv_lora]
        return kv.reshape(-1, kv.shape[-1])

    def check_done(self, path: str) -> None:
        if self.pending:
            layer, part = next(iter(self.pending))
            raise ValueError(f"{path}: GGUF {layer} has attn_{part}_b but not its other half")


def deepseek2_config(m: GGUFMeta, generic: GGUFConfig) -> GGUFConfig:
    """The config of a deepseek2 file (DeepseekV2Config or V3's); `m(key)` reads `deepseek2.<key>`, `generic`
    holds the keys every architecture shares (copied, not changed)."""
    import gguf

    tensors = m.tensors
    kw = dict(generic.kwargs)
    kw.pop("head_dim", None)  # key_length is the latent's width here; the configs derive head_dim themselves
    heads = kw["num_attention_heads"]
    rope_dim = int(m("rope.dimension_count"))
    kv_lora = m("attention.kv_lora_rank")
    key = m("attention.key_length_mla") or m("attention.key_length")
    value = m("attention.value_length_mla") or m("attention.value_length")
    if not (kv_lora and key and value):
        raise ValueError("GGUF architecture 'deepseek2' needs deepseek2.attention.kv_lora_rank, key_length and "
                         "value_length (or key_length_mla / value_length_mla)")
    q_lora = int(m("attention.q_lora_rank", 0) or 0)
    experts = int(m("expert_count", 0) or 0)
    gating = int(m("expert_gating_func", 0) or 0)
    bias = any(n.endswith("exp_probs_b.bias") for n in tensors)
    v3 = gating == int(gguf.ExpertGatingFuncType.SIGMOID) or bias
    n_group = int(m("expert_group_count", 1) or 1)
    kw.update(
        num_key_value_heads=heads,  # the file says 1 (MLA as MQA); the HF configs carry the query heads
        kv_lora_rank=int(kv_lora), q_lora_rank=q_lora or None,
        qk_rope_head_dim=rope_dim, qk_nope_head_dim=int(key) - rope_dim, v_head_dim=int(value),
        first_k_dense_replace=int(m("leading_dense_block_count", 0) or 0),
        n_routed_experts=experts or None,
        num_experts_per_tok=int(m("expert_used_count", 0) or 0) or None,
        moe_intermediate_size=int(m("expert_feed_forward_length", 0) or kw["intermediate_size"]),
        n_shared_experts=int(m("expert_shared_count", 0) or 0),
        routed_scaling_factor=float(m("expert_weights_scale", 1.0) or 1.0),
        norm_topk_prob=bool(m("expert_weights_norm", False)),
        n_group=n_group, topk_group=int(m("expert_group_used_count", 1) or 1),
        attention_bias="blk.0.attn_kv_a_mqa.bias" in tensors,
    )
    if v3:
        kw["rope_interleave"] = True  # llama.cpp rotates adjacent pairs (and converts no other layout)
    else:
        kw["topk_method"] = "group_limited_greedy" if n_group > 1 else "greedy"
    rope = dict(kw["rope_parameters"])
    if rope.get("rope_type") == "yarn":
        rope["beta_fast"] = float(m("rope.scaling.yarn_beta_fast", 32.0))  # llama.cpp's defaults
        rope["beta_slow"] = float(m("rope.scaling.yarn_beta_slow", 1.0))
        log_mul = float(m("rope.scaling.yarn_log_multiplier", 0.0) or 0.0)
        if log_mul > 0:
            rope["mscale"] = rope["mscale_all_dim"] = log_mul / 0.1
        else:  # no softmax temperature and, as llama.cpp's graph, none on cos/sin either
            rope["attention_factor"] = 1.0
        kw["rope_parameters"] = rope
    if v3:
        return GGUFConfig("DeepseekV3Config", "DeepseekV3ForCausalLM", kw)
    return GGUFConfig("DeepseekV2Config", "DeepseekV2ForCausalLM", kw)


# MLA + DeepSeekMoE: its own keys, tensor names and joined kv_b_proj; no rows permuted (see the top)
register_gguf(GGUFArch("deepseek2", "DeepseekV2Config", "DeepseekV2ForCausalLM", config=deepseek2_config,
                       tensor_names=deepseek2_tensor_names, joiner=lambda cfg, blocks: KvBJoiner()))
