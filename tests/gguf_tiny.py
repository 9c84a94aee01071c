"""Write a tiny HF model folder out as a GGUF file, the way llama.cpp's converter lays it out
(names, Q/K row permutation for Llama, +1 on Gemma norms), optionally quantized."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

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


def write_gguf(hf_dir: str | Path, out: str | Path, qtype=None) -> Path:
    import gguf
    from safetensors.torch import load_file
    import transformers as tf

    cfg = tf.AutoConfig.from_pretrained(hf_dir)
    arch = "gemma3" if cfg.model_type.startswith("gemma3") else "llama"
    qtype = qtype or gguf.GGMLQuantizationType.F32
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
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
        if a.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            q = gguf.quants.quantize(a, qtype)
            w.add_tensor(g, q, raw_shape=q.shape, raw_dtype=qtype)
        else:
            w.add_tensor(g, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)
