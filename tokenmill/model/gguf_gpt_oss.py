"""gpt-oss GGUF files (llama.cpp's `gpt-oss` architecture): the transformers config from its metadata keys and its
tensor names, as llama.cpp's convert_hf_to_gguf.py writes them.

What the converter does that a loader has to undo:
- The experts' interleaved gate_up_proj [E, H, 2I] is split into `ffn_gate_exps` and `ffn_up_exps` ([E, I, H] each,
  columns 0::2 and 1::2, transposed), with their biases; down_proj [E, I, H] is written transposed as
  `ffn_down_exps` [E, H, I]. ExpertJoiner puts them back into transformers' form, one layer at a time.
- The router is `ffn_gate_inp` (weight and bias), the sinks `attn_sinks` [H], the pre-MLP norm
  `post_attention_norm`; q/k rows are not permuted (llama.cpp rotates gpt-oss's halves as transformers does).
- Sliding-window layers alternate from the first (llama.cpp's swa pattern 2), window `attention.sliding_window`.
- YaRN from `rope.scaling.*`; its beta_fast/beta_slow (32, 1) and gpt-oss's untruncated correction range are not in
  the file and are gpt-oss's fixed values. The SwiGLU limit is `swiglu_clamp_exp` (else 7.0); alpha is 1.702.
Expert weights of any type the gguf package dequantizes (MXFP4 included) are dequantized into float at load, as
for the other GGUF MoE families.
"""
from __future__ import annotations

import numpy as np

# GGUF block part (gguf.constants.MODEL_TENSOR member) -> transformers part of a gpt-oss layer, per suffix
_PARTS = {
    "ATTN_NORM": {"weight": "input_layernorm.weight"},
    "ATTN_POST_NORM": {"weight": "post_attention_layernorm.weight"},
    "ATTN_Q": {"weight": "self_attn.q_proj.weight", "bias": "self_attn.q_proj.bias"},
    "ATTN_K": {"weight": "self_attn.k_proj.weight", "bias": "self_attn.k_proj.bias"},
    "ATTN_V": {"weight": "self_attn.v_proj.weight", "bias": "self_attn.v_proj.bias"},
    "ATTN_OUT": {"weight": "self_attn.o_proj.weight", "bias": "self_attn.o_proj.bias"},
    "ATTN_SINKS": {"weight": "self_attn.sinks"},
    "FFN_GATE_INP": {"weight": "mlp.router.weight", "bias": "mlp.router.bias"},
    # joined by ExpertJoiner into mlp.experts.gate_up_proj(_bias); down transposed back
    "FFN_GATE_EXP": {"weight": "mlp.experts.gate_proj", "bias": "mlp.experts.gate_proj_bias"},
    "FFN_UP_EXP": {"weight": "mlp.experts.up_proj", "bias": "mlp.experts.up_proj_bias"},
    "FFN_DOWN_EXP": {"weight": "mlp.experts.down_proj", "bias": "mlp.experts.down_proj_bias"},
}


def gpt_oss_tensor_names(num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> transformers name (gate/up experts: the split halves' own names, for ExpertJoiner)."""
    import gguf

    T, names = gguf.MODEL_TENSOR, gguf.TENSOR_NAMES
    out = {f"{names[T.TOKEN_EMBD]}.weight": "model.embed_tokens.weight",
           f"{names[T.OUTPUT_NORM]}.weight": "model.norm.weight",
           f"{names[T.OUTPUT]}.weight": "lm_head.weight"}
    for part, suffixes in _PARTS.items():
        for i in range(num_layers):
            for suffix, hf in suffixes.items():
                out[f"{names[getattr(T, part)].format(bid=i)}.{suffix}"] = f"model.layers.{i}.{hf}"
    return out


def gpt_oss_config(m, tensors: dict, kw: dict) -> tuple[tuple[str, str], dict]:
    """(config class name, architectures entry) and the GptOssConfig keyword arguments."""
    if not m("attention.sliding_window"):
        raise ValueError("GGUF gpt-oss file without gpt-oss.attention.sliding_window")
    layers = kw["num_hidden_layers"]
    kw = dict(kw, num_local_experts=int(m("expert_count")), num_experts_per_tok=int(m("expert_used_count")),
              intermediate_size=int(m("expert_feed_forward_length")),
              sliding_window=int(m("attention.sliding_window")),
              layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
              swiglu_limit=float(m("swiglu_clamp_exp", 7.0) or 7.0), attention_bias="blk.0.attn_q.bias" in tensors)
    rope = dict(kw["rope_parameters"])
    if rope.get("rope_type") == "yarn":
        rope.update(beta_fast=32.0, beta_slow=1.0, truncate=False)
    kw["rope_parameters"] = rope
    return ("GptOssConfig", "GptOssForCausalLM"), kw


class ExpertJoiner:
    """Turns a layer's split expert tensors back into transformers' gate_up_proj [E, H, 2I] (interleaved) and
    gate_up_proj_bias [E, 2I], and ffn_down_exps [E, H, I] into down_proj [E, I, H]; other tensors pass."""

    def __init__(self) -> None:
        self._halves: dict[str, dict[str, np.ndarray]] = {}  # joined name -> {"gate"|"up": array}

    def add(self, hf: str, w: np.ndarray) -> list[tuple[str, np.ndarray]]:
        prefix, _, leaf = hf.rpartition(".experts.")
        if not prefix:
            return [(hf, w)]
        if leaf == "down_proj":
            return [(hf, np.swapaxes(w, 1, 2))]
        if leaf == "down_proj_bias":
            return [(hf, w)]
        half, bias = leaf.split("_proj")[0], leaf.endswith("_bias")
        joined = f"{prefix}.experts.gate_up_proj" + ("_bias" if bias else "")
        halves = self._halves.setdefault(joined, {})
        halves[half] = np.swapaxes(w, 1, 2) if not bias else w  # weight [E, I, H] -> [E, H, I]
        if len(halves) < 2:
            return []
        gate, up = halves["gate"], halves["up"]
        del self._halves[joined]
        out = np.empty(gate.shape[:-1] + (2 * gate.shape[-1],), dtype=gate.dtype)
        out[..., 0::2], out[..., 1::2] = gate, up
        return [(joined, out)]

    def check_done(self, path: str) -> None:
        if self._halves:
            raise ValueError(f"{path}: expert tensors without their other half: {', '.join(sorted(self._halves))}")
