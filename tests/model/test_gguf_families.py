"""GGUF files of Granite, OLMo 2, Phi-3, Gemma 2 and GLM-4 (llama.cpp's `general.architecture` names, tensor
names and metadata keys, written with the gguf package from a tiny random transformers checkpoint) load and give
transformers' greedy tokens on the same weights: F32 against the checkpoint itself, Q8_0 (kept as blocks by
default) against the checkpoint with every matrix replaced by its Q8_0 round trip."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from gguf_tiny import write_family_gguf
from test_model_families import FAMILIES as HF_FAMILIES, GRANITE, make_family_model
from test_parity import check_against_oracle, hf_greedy, prompts_for, NEW_TOKENS
from tokenmill import LLM, SamplingParams

gguf = pytest.importorskip("gguf")

# Gemma 2 with query_pre_attn_scalar = head_dim: llama.cpp's gemma2 has no key for it (1/sqrt(head_dim), but
# hidden / heads for the 46-layer 27B), so a GGUF can only say that; caps small enough to bind.
GEMMA2 = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=24, attn_logit_softcapping=2.0,
              final_logit_softcapping=5.0, num_hidden_layers=4)
FAMILIES = {
    "granite": ("GraniteConfig", GRANITE),
    "olmo2": ("Olmo2Config", {}),
    "phi3": ("Phi3Config", {}),
    "phi4mini-partial": ("Phi3Config", dict(partial_rotary_factor=0.75, tie_word_embeddings=True)),
    # LongRoPE (short factors up to original_max_position_embeddings = 256; max_model_len 128 here), also on 3/4
    # of each head as Phi-4-mini: factors from the rope_factors_long/short tensors, attention factor from its key
    "phi3-longrope": HF_FAMILIES["phi3-longrope"],
    "phi4mini-partial-longrope": HF_FAMILIES["phi4mini-partial-longrope"],
    "gemma2": ("Gemma2Config", GEMMA2),
    "glm4": ("Glm4Config", {}),
}


def q8_round_trip(folder, out):
    """A copy of `folder` whose 2-D tensors are their Q8_0 dequantization (what the GGUF holds)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    state = load_file(str(folder / "model.safetensors"))
    T = gguf.GGMLQuantizationType.Q8_0
    for name, t in state.items():
        if t.dim() == 2:
            a = t.float().numpy()
            state[name] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(a, T), T).reshape(a.shape))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("qname", ["F32", "Q8_0"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_gguf_matches_transformers(tmp_path, family, qname):
    config_class, overrides = FAMILIES[family]
    folder = make_family_model(tmp_path / family, config_class, **overrides)
    qtype = getattr(gguf.GGMLQuantizationType, qname)
    path = write_family_gguf(folder, tmp_path / f"{family}.{qname}.gguf", qtype=qtype)
    ref_folder = folder if qname == "F32" else q8_round_trip(folder, tmp_path / f"{family}-q8")
    llm = LLM(str(path), tokenizer=str(folder), max_model_len=128, num_gpu_blocks_override=64)
    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    assert llm.engine.hf_config.architectures == [arch]
    prompts = prompts_for(llm.engine.vocab_size)
    oracle = hf_greedy(ref_folder, prompts)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=3)
    check_against_oracle(llm.generate(prompts, sp, use_tqdm=False), oracle, f"{family} {qname} GGUF")


def test_family_gguf_config(tmp_path):
    """The config read from the GGUF metadata carries each family's fields."""
    from tokenmill.model.gguf_loader import hf_config_from_gguf

    got = {}
    for family in ("granite", "gemma2", "glm4", "phi4mini-partial"):
        config_class, overrides = FAMILIES[family]
        folder = make_family_model(tmp_path / family, config_class, **overrides)
        got[family] = hf_config_from_gguf(str(write_family_gguf(folder, tmp_path / f"{family}.gguf")))
    g = got["granite"]
    assert g.architectures == ["GraniteForCausalLM"]
    assert (g.embedding_multiplier, g.residual_multiplier, g.attention_multiplier, g.logits_scaling) == \
        (4.0, 0.5, pytest.approx(0.2), 2.0)
    g = got["gemma2"]
    assert g.architectures == ["Gemma2ForCausalLM"] and g.head_dim == 16 and g.query_pre_attn_scalar == 16
    assert (g.attn_logit_softcapping, g.final_logit_softcapping, g.sliding_window) == (2.0, 5.0, 24)
    g = got["glm4"]
    assert g.architectures == ["Glm4ForCausalLM"] and g.head_dim == 128 and g.attention_bias  # Glm4Config default
    assert g.rope_parameters["partial_rotary_factor"] == 0.5
    g = got["phi4mini-partial"]
    assert g.architectures == ["Phi3ForCausalLM"] and g.head_dim == 16
    assert g.rope_parameters["partial_rotary_factor"] == 0.75


def test_unsupported_gguf_architecture_is_named(tmp_path):
    from tokenmill.model.gguf_loader import hf_config_from_gguf

    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="falcon"):
        hf_config_from_gguf(str(path))


def test_phi3_longrope_gguf_without_its_context_length_refused(tmp_path, monkeypatch):
    """LongRoPE factors without rope.scaling.original_context_length: refused at load, naming what is missing."""
    from tokenmill.model.gguf_loader import hf_config_from_gguf

    config_class, overrides = FAMILIES["phi3-longrope"]
    folder = make_family_model(tmp_path / "phi3", config_class, **overrides)
    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_scaling_orig_ctx_len", lambda self, value: None)
    path = write_family_gguf(folder, tmp_path / "phi3-long.gguf")
    with pytest.raises(ValueError, match="phi3.*LongRoPE needs.*original_context_length"):
        hf_config_from_gguf(str(path))
