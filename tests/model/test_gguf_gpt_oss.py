"""gpt-oss GGUF files (llama.cpp's `gpt-oss` architecture: experts' gate and up split into ffn_gate_exps /
ffn_up_exps and transposed, down transposed, router ffn_gate_inp, attn_sinks, post_attention_norm), written with the
gguf package from test_gpt_oss's tiny random checkpoint, load and give transformers' greedy tokens and logprobs on
the same weights: F32 against the checkpoint itself; MXFP4 experts (the gguf package's quantizer) with Q8_0
attention (both kept as the file's blocks; the experts' MXFP4 bytes reordered into the checkpoints' MXFP4 form) against
the checkpoint with those tensors replaced by what the file stores, and the same file with --quantization none
(everything dequantized at load)."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from test_gpt_oss import make_gpt_oss
from test_parity import NEW_TOKENS, check_against_oracle, hf_greedy, prompts_for
from tokenmill import LLM, SamplingParams

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
# llama.cpp's gpt-oss graph has swiglu alpha 1.702 and limit 7.0 built in: the checkpoint keeps gpt-oss's defaults.
CONFIG = dict(swiglu_limit=7.0)


def gguf_arrays(state: dict[str, torch.Tensor], layers: int):
    """(GGUF name, float32 array) as llama.cpp's convert_hf_to_gguf.py lays gpt-oss out."""
    yield "token_embd.weight", state["model.embed_tokens.weight"]
    yield "output_norm.weight", state["model.norm.weight"]
    yield "output.weight", state["lm_head.weight"]
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        yield b + "attn_norm.weight", state[p + "input_layernorm.weight"]
        yield b + "post_attention_norm.weight", state[p + "post_attention_layernorm.weight"]
        for g, hf in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
            for kind in ("weight", "bias"):
                yield f"{b}{g}.{kind}", state[f"{p}self_attn.{hf}.{kind}"]
        yield b + "attn_sinks.weight", state[p + "self_attn.sinks"]
        yield b + "ffn_gate_inp.weight", state[p + "mlp.router.weight"]
        yield b + "ffn_gate_inp.bias", state[p + "mlp.router.bias"]
        gate_up, gate_up_bias = state[p + "mlp.experts.gate_up_proj"], state[p + "mlp.experts.gate_up_proj_bias"]
        yield b + "ffn_gate_exps.weight", gate_up[..., 0::2].transpose(1, 2)
        yield b + "ffn_up_exps.weight", gate_up[..., 1::2].transpose(1, 2)
        yield b + "ffn_gate_exps.bias", gate_up_bias[..., 0::2]
        yield b + "ffn_up_exps.bias", gate_up_bias[..., 1::2]
        yield b + "ffn_down_exps.weight", state[p + "mlp.experts.down_proj"].transpose(1, 2)
        yield b + "ffn_down_exps.bias", state[p + "mlp.experts.down_proj_bias"]


def stored_type(name: str, experts, attention):
    if "_exps.weight" in name:
        return experts
    if name.startswith("blk.") and name.split(".")[2] in ("attn_q", "attn_k", "attn_v", "attn_output") \
            and name.endswith(".weight"):
        return attention
    return None  # float32


def write_gpt_oss_gguf(folder: Path, out: Path, experts=None, attention=None) -> Path:
    from safetensors.torch import load_file
    import transformers as tf

    cfg = tf.AutoConfig.from_pretrained(folder)
    w = gguf.GGUFWriter(str(out), "gpt-oss")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_sliding_window(cfg.sliding_window)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    state = load_file(str(folder / "model.safetensors"))
    for g, t in gguf_arrays(state, cfg.num_hidden_layers):
        a = np.ascontiguousarray(t.float().numpy())
        qtype = stored_type(g, experts, attention)
        if qtype is None:
            w.add_tensor(g, a)
        else:
            q = gguf.quants.quantize(a.reshape(-1, a.shape[-1]), qtype).reshape(*a.shape[:-1], -1)
            w.add_tensor(g, q, raw_shape=q.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def round_trip(folder: Path, out: Path, experts, attention) -> Path:
    """A copy of the checkpoint whose tensors hold what the file stores for them (each quantized matrix through its
    type and back, in the file's layout)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    state = load_file(str(folder / "model.safetensors"))

    def back(a: torch.Tensor, qtype) -> torch.Tensor:
        if qtype is None:
            return a
        x = a.float().numpy().reshape(-1, a.shape[-1])
        return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype).reshape(a.shape))

    for name in list(state):
        if name.endswith("experts.gate_up_proj"):  # [E, H, 2I]; the file holds [E, I, H] halves
            gate_up = state[name].clone()
            for half in (0, 1):
                gate_up[..., half::2] = back(gate_up[..., half::2].transpose(1, 2).contiguous(), experts).transpose(1, 2)
            state[name] = gate_up
        elif name.endswith("experts.down_proj"):
            state[name] = back(state[name].transpose(1, 2).contiguous(), experts).transpose(1, 2).contiguous()
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
            state[name] = back(state[name], attention)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


CASES = {"f32": (None, None), "mxfp4-experts-q8_0-attention": (T.MXFP4, T.Q8_0)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gpt_oss_gguf_matches_transformers(tmp_path, case):
    experts, attention = CASES[case]
    folder = make_gpt_oss(tmp_path / "hf", **CONFIG)
    path = write_gpt_oss_gguf(folder, tmp_path / f"{case}.gguf", experts, attention)
    ref = folder if experts is None else round_trip(folder, tmp_path / "ref", experts, attention)
    llm = LLM(str(path), tokenizer=str(folder), max_model_len=128, num_gpu_blocks_override=64,
              attention_backend="torch_sdpa")
    assert llm.engine.hf_config.architectures == ["GptOssForCausalLM"]
    assert [a.sliding_window for a in llm.engine.runner.attn_layers] == [8, None, 8, None]
    if attention is not None and llm.engine.model.quant_config is not None:  # the GGUF block kernels are built
        layer = llm.engine.model.layers[0]
        assert layer.self_attn.o_proj.weight.dtype == torch.uint8
        # the file's MXFP4 experts stay MXFP4 (their bytes reordered into the checkpoints' form), no float copy
        names = {n for n, _ in layer.mlp.experts.named_parameters()}
        assert {"gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales"} <= names
        assert "gate_up_proj" not in names and layer.mlp.experts.gate_up_proj_blocks.dtype == torch.uint8
    prompts = prompts_for(llm.engine.vocab_size)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=3)
    check_against_oracle(llm.generate(prompts, sp, use_tqdm=False), hf_greedy(ref, prompts), f"{case} GGUF")


def test_gpt_oss_gguf_dequantized_with_quantization_none(tmp_path):
    folder = make_gpt_oss(tmp_path / "hf", **CONFIG)
    path = write_gpt_oss_gguf(folder, tmp_path / "m.gguf", T.MXFP4, T.Q8_0)
    ref = round_trip(folder, tmp_path / "ref", T.MXFP4, T.Q8_0)
    llm = LLM(str(path), tokenizer=str(folder), max_model_len=128, num_gpu_blocks_override=64,
              attention_backend="torch_sdpa", quantization="none")
    experts = llm.engine.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float32
    prompts = prompts_for(llm.engine.vocab_size)[:4]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=3)
    check_against_oracle(llm.generate(prompts, sp, use_tqdm=False), hf_greedy(ref, prompts), "dequantized GGUF")


def test_gpt_oss_gguf_config(tmp_path):
    import transformers as tf

    from tokenmill.model.gguf_loader import hf_config_from_gguf

    folder = make_gpt_oss(tmp_path / "hf", **CONFIG)
    want = tf.AutoConfig.from_pretrained(folder)
    got = hf_config_from_gguf(str(write_gpt_oss_gguf(folder, tmp_path / "f.gguf")))
    assert type(got) is type(want) and got.architectures == want.architectures
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok",
                "intermediate_size", "num_hidden_layers", "sliding_window", "layer_types", "swiglu_limit",
                "swiglu_alpha", "attention_bias"):
        assert getattr(got, key) == getattr(want, key), key
    for key in ("rope_type", "rope_theta", "factor", "beta_fast", "beta_slow", "truncate",
                "original_max_position_embeddings"):
        assert got.rope_parameters[key] == want.rope_parameters[key], key
