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
Experts stored as MXFP4 (every layer's three expert tensors) stay MXFP4 where the file's blocks are kept
(`--quantization gguf`, the default for a .gguf with the native kernels): ggml's MXFP4 block (an e8m0 byte, then 16
bytes holding element j in the low nibble of byte j and element j + 16 in its high nibble) is the same code and
scale as the checkpoints' `*_blocks` / `*_scales` (element 2i low, 2i + 1 high), so the bytes are only reordered
into that form (config `gguf_expert_type` MXFP4 tells the model to hold them so). Experts of other types, or with
`--quantization none`, are dequantized into float at load, as for the other GGUF MoE families.
"""
from __future__ import annotations

import numpy as np

from tokenmill.model.gguf_arch import GGUFArch, GGUFConfig, GGUFMeta, TensorJoiner
from tokenmill.model.hf_config import hf_get
from tokenmill.model.registry import register_gguf

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
    for part, suffixes in _PARTS.items():  # part: a gguf.MODEL_TENSOR member's name (getattr: the enum by name)
        for i in range(num_layers):
            for suffix, hf in suffixes.items():
                out[f"{names[getattr(T, part)].format(bid=i)}.{suffix}"] = f"model.layers.{i}.{hf}"
    return out


def gpt_oss_config(m: GGUFMeta, generic: GGUFConfig) -> GGUFConfig:
    """The GptOssConfig of a gpt-oss file; `generic` holds the keys every architecture shares."""
    if not m("attention.sliding_window"):
        raise ValueError("GGUF gpt-oss file without gpt-oss.attention.sliding_window")
    tensors = m.tensors
    layers = generic.kwargs["num_hidden_layers"]
    kw = dict(generic.kwargs, num_local_experts=int(m("expert_count")), num_experts_per_tok=int(m("expert_used_count")),
              intermediate_size=int(m("expert_feed_forward_length")),
              sliding_window=int(m("attention.sliding_window")),
              layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
              swiglu_limit=float(m("swiglu_clamp_exp", 7.0) or 7.0), attention_bias="blk.0.attn_q.bias" in tensors)
    expert_types = {int(t.ggml_type) for name, t in tensors.items() if "_exps.weight" in name}
    if expert_types == {int(gguf_types().MXFP4)}:
        kw["gguf_expert_type"] = "MXFP4"
    rope = dict(kw["rope_parameters"])
    if rope.get("rope_type") == "yarn":
        rope.update(beta_fast=32.0, beta_slow=1.0, truncate=False)
    kw["rope_parameters"] = rope
    return GGUFConfig("GptOssConfig", "GptOssForCausalLM", kw)


def gguf_types():
    import gguf

    return gguf.GGMLQuantizationType


def mxfp4_from_ggml(raw: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """A ggml MXFP4 tensor's bytes (numpy shape `shape` = [E, rows, cols]) -> (blocks uint8 [E, rows, cols/32, 16]
    in the checkpoints' nibble order, scales uint8 [E, rows, cols/32])."""
    E, rows, cols = shape
    b = raw.reshape(E, rows, cols // 32, 17)
    qs = b[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # elements 0..15, then 16..31
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), np.ascontiguousarray(b[..., 0])


class ExpertJoiner(TensorJoiner):
    """Turns a layer's split expert tensors back into transformers' gate_up_proj [E, H, 2I] (interleaved) and
    gate_up_proj_bias [E, 2I], and ffn_down_exps [E, H, I] into down_proj [E, I, H]; other tensors pass."""

    def __init__(self, keep_mxfp4: bool = False) -> None:
        self._halves: dict[str, dict[str, np.ndarray]] = {}  # joined name -> {"gate"|"up": array}
        self.keep_mxfp4 = keep_mxfp4  # the model holds MXFP4 experts: take their bytes (add_mxfp4)

    def take_raw(self, hf: str, ggml_type: int, raw: np.ndarray,
                 shape: tuple[int, ...]) -> list[tuple[str, np.ndarray]] | None:
        return self.add_mxfp4(hf, raw, shape) if self.keeps(hf, ggml_type) else None

    def keeps(self, hf: str, ggml_type: int) -> bool:
        return self.keep_mxfp4 and ".experts." in hf and not hf.endswith("_bias") and \
            ggml_type == int(gguf_types().MXFP4)

    def add_mxfp4(self, hf: str, raw: np.ndarray, shape: tuple[int, ...]) -> list[tuple[str, np.ndarray]]:
        """An MXFP4 expert weight's bytes -> the checkpoints' *_blocks / *_scales (gate and up interleaved by row
        into gate_up_proj_*, as the MXFP4 checkpoints hold them; down as it is: [E, H, I/32, ...])."""
        blocks, scales = mxfp4_from_ggml(raw, shape)
        prefix, _, leaf = hf.rpartition(".experts.")
        if leaf == "down_proj":
            return [(f"{hf}_blocks", blocks), (f"{hf}_scales", scales)]
        half = leaf.split("_proj")[0]
        out = []
        for kind, a in (("blocks", blocks), ("scales", scales)):
            joined = f"{prefix}.experts.gate_up_proj_{kind}"
            halves = self._halves.setdefault(joined, {})
            halves[half] = a
            if len(halves) == 2:
                del self._halves[joined]
                g = halves["gate"]
                both = np.empty((g.shape[0], 2 * g.shape[1]) + g.shape[2:], dtype=g.dtype)
                both[:, 0::2], both[:, 1::2] = g, halves["up"]
                out.append((joined, both))
        return out

    def add(self, gguf_name: str, hf: str, w: np.ndarray) -> list[tuple[str, np.ndarray]]:
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


def _joiner(cfg, blocks: bool) -> ExpertJoiner:
    """MXFP4 experts stay MXFP4 where the file's blocks are kept and every expert tensor is MXFP4."""
    return ExpertJoiner(keep_mxfp4=blocks and hf_get(cfg, "gguf_expert_type") == "MXFP4")


# sinks, alternating windows and its MoE: its own keys and tensor names; q/k rows not permuted (see the top)
register_gguf(GGUFArch("gpt-oss", "GptOssConfig", "GptOssForCausalLM", config=gpt_oss_config,
                       tensor_names=gpt_oss_tensor_names, joiner=_joiner))
