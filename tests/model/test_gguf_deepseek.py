"""DeepSeek-V2 / V3 GGUF files (llama.cpp's `deepseek2`: MLA written as MQA, kv_b_proj split into k_b / v_b or,
from older converters, whole; experts merged; V3's correction bias as exp_probs_b), written with the gguf package
from test_deepseek's tiny random checkpoints, load and give transformers' greedy tokens and logprobs on the same
weights: F32 against the checkpoint itself, F16 and Q8_0 (kept as blocks where a kernel takes them) against the
checkpoint with every tensor replaced by its round trip through what the file stores."""
from __future__ import annotations

import json

import pytest
import torch

from gguf_tiny import deepseek_round_trip, write_deepseek_gguf
from test_deepseek import VARIANTS, make_deepseek
from test_parity import NEW_TOKENS, check_against_oracle, hf_greedy, prompts_for
from tokenmill import LLM, SamplingParams

gguf = pytest.importorskip("gguf")

# Q8_0 blocks are 32 values: with qk_nope_head_dim and q_lora_rank 32 every matrix's rows are whole blocks (k_b's
# rows are qk_nope long, q_b_proj's q_lora_rank), so all but the router are stored quantized.
WHOLE_BLOCKS = dict(qk_nope_head_dim=32, q_lora_rank=32)
CASES = {
    # (variant, file type, kv_b split into k_b / v_b, config overrides)
    "v2-f32": ("v2", "F32", True, {}),
    "v3-f32": ("v3", "F32", True, {}),
    "v2-f16-whole-kv_b": ("v2", "F16", False, {}),
    "v3-q8_0": ("v3", "Q8_0", True, WHOLE_BLOCKS),
    "v2-q8_0": ("v2", "Q8_0", True, dict(qk_nope_head_dim=32)),
}


def tiny(tmp_path, variant: str, **extra):
    config_class, overrides = VARIANTS[variant]
    return make_deepseek(tmp_path / variant, config_class, **dict(overrides, **extra))


@pytest.mark.parametrize("case", sorted(CASES))
def test_deepseek_gguf_matches_transformers(tmp_path, case):
    variant, qname, split, extra = CASES[case]
    folder = tiny(tmp_path, variant, **extra)
    qtype = getattr(gguf.GGMLQuantizationType, qname)
    path = write_deepseek_gguf(folder, tmp_path / f"{case}.gguf", qtype=qtype, split=split)
    reader = gguf.GGUFReader(str(path))
    stored = {t.name for t in reader.tensors}
    assert ("blk.0.attn_k_b.weight" in stored) == split and ("blk.0.attn_kv_b.weight" in stored) != split
    ref = folder if qname == "F32" else deepseek_round_trip(folder, tmp_path / f"{case}-ref", qtype, split)
    llm = LLM(str(path), tokenizer=str(folder), max_model_len=128, num_gpu_blocks_override=64)
    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    assert llm.engine.hf_config.architectures == [arch]
    if qname == "Q8_0":  # the attention projections run on the file's blocks
        attn = llm.engine.model.layers[1].self_attn
        assert attn.o_proj.weight.dtype == torch.uint8 and attn.kv_a_proj_with_mqa.weight.dtype == torch.uint8
    prompts = prompts_for(llm.engine.vocab_size)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=3)
    check_against_oracle(llm.generate(prompts, sp, use_tqdm=False), hf_greedy(ref, prompts), f"{case} GGUF")


@pytest.mark.parametrize("split", [True, False], ids=["k_b-v_b", "whole-kv_b"])
def test_deepseek_gguf_config(tmp_path, split):
    """The config read from the metadata has the checkpoint's MLA sizes, router and YaRN parameters, from either
    converter's key_length / value_length."""
    import transformers as tf

    from tokenmill.model.gguf_loader import hf_config_from_gguf

    for variant in sorted(VARIANTS):
        folder = tiny(tmp_path, variant)
        want = tf.AutoConfig.from_pretrained(folder)
        got = hf_config_from_gguf(str(write_deepseek_gguf(folder, tmp_path / f"{variant}.gguf", split=split)))
        assert type(got) is type(want) and got.architectures == want.architectures
        for key in ("num_attention_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                    "v_head_dim", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                    "n_shared_experts", "first_k_dense_replace", "routed_scaling_factor", "n_group", "topk_group",
                    "intermediate_size", "num_hidden_layers"):
            assert getattr(got, key) == getattr(want, key), (variant, key)
        assert bool(got.norm_topk_prob) == bool(want.norm_topk_prob), variant
        if variant == "v2":
            assert got.topk_method == want.topk_method
        rope, want_rope = got.rope_parameters, want.rope_parameters
        for key in ("rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
                    "beta_slow", "mscale", "mscale_all_dim"):
            if key in want_rope:
                assert rope[key] == pytest.approx(want_rope[key]), (variant, key)


def test_deepseek_gguf_missing_v_b_refused(tmp_path, monkeypatch):
    """A layer with attn_k_b but no attn_v_b cannot make kv_b_proj: refused at load, naming the layer."""
    import gguf_tiny

    folder = tiny(tmp_path, "v2")
    arrays = gguf_tiny.deepseek_gguf_arrays
    monkeypatch.setattr(gguf_tiny, "deepseek_gguf_arrays", lambda *a, **k: (
        (g, x) for g, x in arrays(*a, **k) if g != "blk.1.attn_v_b.weight"))
    path = write_deepseek_gguf(folder, tmp_path / "no-v_b.gguf")
    with pytest.raises(ValueError, match="blk.1 has attn_k_b but not its other half"):
        LLM(str(path), tokenizer=str(folder), max_model_len=64, num_gpu_blocks_override=8)
