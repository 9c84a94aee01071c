"""Write a tiny HF model folder out as a GGUF file, the way llama.cpp's converter lays it out
(names, Q/K row permutation for Llama, +1 on Gemma norms), optionally quantized."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import numpy as np
import torch

def smollm2_layout(name: str):
    """SmolLM2's mix of types, and one without a kernel: token_embd Q8_0 (tied to the LM head), ffn Q4_1,
    attention Q4_0 but attn_output Q5_0 (dequantized at load). A `types` argument for write_gguf."""
    import gguf

    T = gguf.GGMLQuantizationType
    if name == "token_embd.weight":
        return T.Q8_0
    return T.Q5_0 if "attn_output" in name else (T.Q4_1 if "ffn" in name else T.Q4_0)


LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
}
LLAMA_NORMS = {"post_attention_layernorm": "ffn_norm"}
GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float32)


def _k_quantize(w: np.ndarray, qmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K/Q5_K math for super-blocks w [nb, 256]: w ~ d*sc*q - dmin*mn per 32 values, sc/mn 6-bit."""
    nb = w.shape[0]
    sub = w.reshape(nb, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale, mn = (sub.max(-1) - lo) / qmax, -lo
    d, dmin = _f16(scale.max(-1) / 63), _f16(mn.max(-1) / 63)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.clip(np.round(scale / d[:, None]), 0, 63), 0).astype(np.uint8)
        mq = np.where(dmin[:, None] > 0, np.clip(np.round(mn / dmin[:, None]), 0, 63), 0).astype(np.uint8)
        eff_s, eff_m = d[:, None] * sc, dmin[:, None] * mq
        q = np.where(eff_s[..., None] > 0, np.round((sub + eff_m[..., None]) / eff_s[..., None]), 0)
    return d, dmin, sc, mq, np.clip(q, 0, qmax).astype(np.uint8).reshape(nb, 256)


def k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins -> the 12 bytes Q4_K/Q5_K store them in."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    return out


def quantize_k(a: np.ndarray, qtype) -> np.ndarray:
    """A plain quantizer for Q4_K, Q5_K and Q6_K (gguf-py only dequantizes them): [rows, K] float ->
    [rows, K / 256 * type_size] block bytes in the ggml layout."""
    import gguf

    T = gguf.GGMLQuantizationType
    rows, K = a.shape
    w = a.astype(np.float32).reshape(-1, 256)
    nb = w.shape[0]
    half = lambda x: x.astype(np.float16).view(np.uint8).reshape(nb, 2)  # noqa: E731
    if qtype in (T.Q4_K, T.Q5_K):
        five = qtype == T.Q5_K
        d, dmin, sc, mn, q = _k_quantize(w, 31 if five else 15)
        low = (q & 0xF).reshape(nb, 4, 2, 32)
        qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(nb, 128)
        parts = [half(d), half(dmin), k_scales(sc, mn)]
        if five:
            bits = ((q.reshape(nb, 8, 32) >> 4) & 1) << np.arange(8, dtype=np.uint8)[None, :, None]
            parts.append(np.bitwise_or.reduce(bits, axis=1).astype(np.uint8))
        blocks = np.concatenate(parts + [qs], axis=1)
    elif qtype == T.Q6_K:
        sub = w.reshape(nb, 16, 16)
        scale = np.abs(sub).max(-1) / 31
        d = _f16(scale.max(-1) / 127)
        with np.errstate(divide="ignore", invalid="ignore"):
            sc = np.where(d[:, None] > 0, np.clip(np.round(scale / d[:, None]), -128, 127), 0)
            eff = d[:, None] * sc
            q = np.where(eff[..., None] > 0, np.round(sub / eff[..., None]), 0)
        q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(nb, 2, 128)
        ql, qh = [], []
        for h in range(2):
            low = (q[:, h] & 0xF).reshape(nb, 2, 64)
            ql.append(low[:, 0] | (low[:, 1] << 4))
            hi = ((q[:, h].reshape(nb, 4, 32) >> 4) & 3) << (2 * np.arange(4, dtype=np.uint8))[None, :, None]
            qh.append(np.bitwise_or.reduce(hi, axis=1).astype(np.uint8))
        blocks = np.concatenate(ql + qh + [sc.astype(np.int8).view(np.uint8), half(d)], axis=1)
    else:
        raise ValueError(f"quantize_k does not do {qtype!r}")
    return blocks.reshape(rows, -1)


def quantize(a: np.ndarray, qtype) -> np.ndarray:
    import gguf

    T = gguf.GGMLQuantizationType
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        return quantize_k(a, qtype)
    return gguf.quants.quantize(a, qtype)


def add_common_header(w, cfg) -> None:
    """The hyper-parameters every decoder GGUF carries (gguf-py's GGUFWriter, a transformers config)."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)


def write_gguf(hf_dir: str | Path, out: str | Path, qtype=None,
               types: Callable[[str], object] | None = None) -> Path:
    """`qtype` for every matrix, or `types(gguf_name)` per matrix (None: float32)."""
    import gguf
    from safetensors.torch import load_file
    import transformers as tf

    cfg = tf.AutoConfig.from_pretrained(hf_dir)
    arch = "gemma3" if cfg.model_type.startswith("gemma3") else "llama"
    qtype = qtype or gguf.GGMLQuantizationType.F32
    w = gguf.GGUFWriter(str(out), arch)
    add_common_header(w, cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch == "gemma3":
        w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(cfg.sliding_window)
    else:
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        w.add_rope_dimension_count(head_dim)
    state = load_file(str(Path(hf_dir) / "model.safetensors"))
    norms = GEMMA_NORMS if arch == "gemma3" else LLAMA_NORMS
    for name, t in state.items():
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            g = "output.weight"
        else:
            parts = name.split(".")
            i, rest, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
            base = LAYER_NAMES.get(rest) or norms.get(rest)
            g = f"blk.{i}.{base}.{kind}"
            if arch == "llama" and rest == "self_attn.q_proj" and kind == "weight":
                a = permute(a, cfg.num_attention_heads)
            if arch == "llama" and rest == "self_attn.k_proj" and kind == "weight":
                a = permute(a, cfg.num_key_value_heads)
        if arch == "gemma3" and g.endswith("norm.weight"):
            a = a + 1.0
        add_tensor(w, g, a, types(g) if types is not None else qtype)
    return finish(w, out)


def add_tensor(w, name: str, a: np.ndarray, qtype) -> None:
    """A matrix as `qtype` blocks (None or F32: float32), anything else as float32."""
    import gguf

    if a.ndim == 2 and qtype is not None and qtype != gguf.GGMLQuantizationType.F32:
        q = quantize(a, qtype)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
    else:
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))


def finish(w, out: str | Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)


# ---- Granite, OLMo 2, Phi-3, Gemma 2, GLM-4 (llama.cpp's convert_hf_to_gguf.py layouts) ----------------------
FAMILY_ARCH = {"granite": "granite", "olmo2": "olmo2", "phi3": "phi3", "gemma2": "gemma2", "glm4": "glm4"}
FAMILY_NAMES = {
    "granite": dict(LAYER_NAMES, **LLAMA_NORMS),
    "olmo2": dict(LAYER_NAMES, post_attention_layernorm="post_attention_norm",
                  post_feedforward_layernorm="post_ffw_norm"),
    "phi3": dict(LAYER_NAMES, **{"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}, **LLAMA_NORMS),
    "gemma2": dict(LAYER_NAMES, **GEMMA_NORMS),
    "glm4": dict(LAYER_NAMES, **{"mlp.gate_up_proj": "ffn_up", "post_self_attn_layernorm": "post_attention_norm",
                                 "post_attention_layernorm": "ffn_norm", "post_mlp_layernorm": "post_ffw_norm"}),
}


def family_gguf_name(arch: str, name: str) -> str:
    """The GGUF tensor name llama.cpp gives a transformers tensor of these families."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    parts = name.split(".")
    i, rest, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    return f"blk.{i}.{FAMILY_NAMES[arch][rest]}.{kind}"


def write_family_gguf(hf_dir: str | Path, out: str | Path, qtype=None) -> Path:
    """A Granite / OLMo 2 / Phi-3 / Gemma 2 / GLM-4 folder as llama.cpp's converter writes it: its metadata keys,
    Granite's Q/K rows permuted (a LlamaModel subclass there), Gemma 2's norms with the 1 added, Phi-3's and
    GLM-4's fused qkv / gate_up kept fused. `qtype` for every matrix (None: float32)."""
    import gguf
    from safetensors.torch import load_file
    import transformers as tf

    cfg = tf.AutoConfig.from_pretrained(hf_dir)
    arch = FAMILY_ARCH[cfg.model_type]
    qtype = qtype or gguf.GGMLQuantizationType.F32
    w = gguf.GGUFWriter(str(out), arch)
    add_common_header(w, cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    if arch != "gemma2":  # llama.cpp's Gemma 2 converter writes no rope base (10000)
        w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if arch == "granite":
        w.add_rope_dimension_count(head_dim)
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    elif arch == "phi3":
        partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) or 1.0
        w.add_rope_dimension_count(int(partial * cfg.hidden_size) // cfg.num_attention_heads)
        w.add_sliding_window(cfg.sliding_window or 0)  # 0: none (Phi-4)
        original = (rope.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings", None)
                    or cfg.max_position_embeddings)
        w.add_rope_scaling_orig_ctx_len(original)
        if rope.get("rope_type") == "longrope":  # two F32 factor tensors and the attention factor, as llama.cpp
            scale = cfg.max_position_embeddings / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
            w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
            w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    elif arch == "gemma2":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    elif arch == "glm4":
        partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 0.5)) or 0.5
        if getattr(cfg, "head_dim", None):
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        w.add_rope_dimension_count(int(head_dim * partial))
    state = load_file(str(Path(hf_dir) / "model.safetensors"))
    for name, t in state.items():
        a = t.float().numpy()
        g = family_gguf_name(arch, name)
        if arch == "granite" and g.endswith("attn_q.weight"):
            a = permute(a, cfg.num_attention_heads)
        if arch == "granite" and g.endswith("attn_k.weight"):
            a = permute(a, cfg.num_key_value_heads)
        if arch == "gemma2" and g.endswith("norm.weight"):
            a = a + 1.0
        add_tensor(w, g, a, qtype)
    return finish(w, out)


# ---- DeepSeek-V2 / V3 (llama.cpp's deepseek2) ------------------------------------------------------------------
DEEPSEEK_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
EXPERT_GGUF = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def deepseek_stores_quantized(gguf_name: str, a: np.ndarray, qtype) -> bool:
    """Whether the DeepSeek writer stores this array as `qtype`: matrices (2-D or merged 3-D) whose rows are whole
    blocks, except the router (llama.cpp's quantize keeps ffn_gate_inp as it is); the rest float32."""
    import gguf

    if qtype is None or qtype == gguf.GGMLQuantizationType.F32 or a.ndim < 2 or "ffn_gate_inp" in gguf_name:
        return False
    return a.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0


def split_kv_b(a: np.ndarray, heads: int, qk_nope: int) -> tuple[np.ndarray, np.ndarray]:
    """kv_b_proj [H * (qk_nope + v), kv_lora] -> (k_b [H, kv_lora, qk_nope], v_b [H, v, kv_lora]), as llama.cpp's
    converter splits it for the absorbed product."""
    kv = a.reshape(heads, -1, a.shape[-1])
    return np.ascontiguousarray(kv[:, :qk_nope].transpose(0, 2, 1)), np.ascontiguousarray(kv[:, qk_nope:])


def deepseek_gguf_arrays(state: dict, cfg, split: bool = True):
    """(GGUF name, float32 array) for a DeepSeek checkpoint's tensors as llama.cpp's converter lays them out:
    experts merged per layer, kv_b_proj split into k_b / v_b (`split`, newer converters) or kept whole, the
    correction bias as exp_probs_b.bias, the MTP layer left out."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, t in state.items():
        a = t.float().numpy()
        if name in top:
            yield top[name], a
            continue
        parts = name.split(".")
        i = parts[2]
        if int(i) >= cfg.num_hidden_layers:
            continue  # the MTP layer: llama.cpp skips it for deepseek2
        rest = ".".join(parts[3:])
        if rest == "mlp.gate.e_score_correction_bias":
            yield f"blk.{i}.exp_probs_b.bias", a
        elif rest.startswith("mlp.experts."):
            e, proj = int(parts[5]), parts[6]
            experts.setdefault((i, proj), {})[e] = a
        elif rest == "self_attn.kv_b_proj.weight" and split:
            k_b, v_b = split_kv_b(a, cfg.num_attention_heads, cfg.qk_nope_head_dim)
            yield f"blk.{i}.attn_k_b.weight", k_b
            yield f"blk.{i}.attn_v_b.weight", v_b
        else:
            base, kind = rest.rsplit(".", 1)
            yield f"blk.{i}.{DEEPSEEK_NAMES[base]}.{kind}", a
    for (i, proj), by_expert in experts.items():
        yield f"blk.{i}.{EXPERT_GGUF[proj]}.weight", np.stack([by_expert[e] for e in sorted(by_expert)])


def write_deepseek_gguf(hf_dir: str | Path, out: str | Path, qtype=None, split: bool = True) -> Path:
    """A DeepSeek-V2 / V3 folder as llama.cpp's convert_hf_to_gguf.py writes it (general.architecture deepseek2):
    MLA as MQA (head_count_kv 1); with `split` (newer converters) key/value_length the latent's widths and the
    per-head sizes in key/value_length_mla, kv_b_proj as k_b / v_b; else key/value_length per head and attn_kv_b.
    `qtype` (F16 or a block type) for the matrices deepseek_stores_quantized names; the rest float32."""
    import gguf
    from safetensors.torch import load_file
    import transformers as tf

    cfg = tf.AutoConfig.from_pretrained(hf_dir)
    v3 = cfg.model_type == "deepseek_v3"
    w = gguf.GGUFWriter(str(out), "deepseek2")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(1)  # MLA written as MQA
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if rope.get(key) is not None:
                add(rope[key])
        if rope.get("mscale_all_dim") is not None:
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    if split:
        w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length_mla(cfg.v_head_dim)
    else:
        w.add_key_length(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.v_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    # the released configs' scoring_func: V3 sigmoid, V2 softmax
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    state = load_file(str(Path(hf_dir) / "model.safetensors"))
    F16 = gguf.GGMLQuantizationType.F16
    for g, a in deepseek_gguf_arrays(state, cfg, split):
        if not deepseek_stores_quantized(g, a, qtype):
            w.add_tensor(g, np.ascontiguousarray(a, dtype=np.float32))
        elif qtype == F16:
            w.add_tensor(g, a.astype(np.float16))
        else:
            q = quantize(a.reshape(-1, a.shape[-1]), qtype).reshape(*a.shape[:-1], -1)
            w.add_tensor(g, q, raw_shape=q.shape, raw_dtype=qtype)
    return finish(w, out)


def deepseek_round_trip(hf_dir: str | Path, out: str | Path, qtype, split: bool = True) -> Path:
    """A copy of a DeepSeek folder whose tensors hold what write_deepseek_gguf stores for them (`qtype` and back,
    in the layout the file has them: kv_b_proj's halves as k_b / v_b), so the file and the folder are one model."""
    import shutil

    import gguf
    import torch
    from safetensors.torch import load_file, save_file
    import transformers as tf

    cfg = tf.AutoConfig.from_pretrained(hf_dir)
    shutil.copytree(hf_dir, out)
    state = load_file(str(Path(hf_dir) / "model.safetensors"))

    def back(g: str, a: np.ndarray) -> np.ndarray:
        if not deepseek_stores_quantized(g, a, qtype):
            return a
        if qtype == gguf.GGMLQuantizationType.F16:
            return a.astype(np.float16).astype(np.float32)
        return gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype).reshape(a.shape)

    for name, t in state.items():
        a = t.float().numpy()
        if name.endswith("self_attn.kv_b_proj.weight") and split:
            k_b, v_b = split_kv_b(a, cfg.num_attention_heads, cfg.qk_nope_head_dim)
            k_b, v_b = back("attn_k_b", k_b), back("attn_v_b", v_b)
            a = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(a.shape)
        elif name.endswith("mlp.gate.weight"):
            a = back("ffn_gate_inp", a)
        else:
            a = back(name, a)  # a per-expert matrix has the merged tensor's rows
        state[name] = torch.from_numpy(np.ascontiguousarray(a)).to(t.dtype)
    save_file({k: v.contiguous() for k, v in state.items()}, str(Path(out) / "model.safetensors"),
              metadata={"format": "pt"})
    return Path(out)
