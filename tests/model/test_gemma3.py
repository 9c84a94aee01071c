"""Gemma 3 (text) greedy output and logprobs equal transformers (the oracle) on tiny random models
with both layer types (sliding window 24, shorter than most prompts), however the batch is formed:
one at a time, all at once, chunked by a 16-token budget, and under a KV pool that forces preemption (with KV
cache groups, the default, and without)."""
from __future__ import annotations

import pytest
import torch

from test_parity import NEW_TOKENS, check_against_oracle, hf_greedy, prompts_for
from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.model.loader import load_hf_config

VARIANTS = {
    "gemma3": {},
    # Like Gemma 3 4B+: linear rope scaling on the full layers only; plus a final logit soft-cap, a
    # non-default local theta, an untied head and a layer pattern that starts with a full layer.
    "gemma3-scaled-softcap": {
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 5e3}},
        "final_logit_softcapping": 4.0,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] + ["sliding_attention"] * 4 + ["full_attention"],
    },
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gemma3_matches_transformers(tmp_path, variant):
    path = make_tiny_model(tmp_path / variant, "gemma3", num_hidden_layers=6, **VARIANTS[variant])
    cfg = load_hf_config(str(path))
    assert cfg.model_type == "gemma3_text" and cfg.architectures == ["Gemma3ForCausalLM"]
    assert {"sliding_attention", "full_attention"} <= set(cfg.layer_types)
    assert cfg.sliding_window < 60

    llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=128, block_size=16)
    windows = [layer.self_attn.attn.sliding_window for layer in llm.engine.model.layers]
    assert windows == [24 if t == "sliding_attention" else None for t in cfg.layer_types]
    prompts = prompts_for(llm.engine.vocab_size)
    oracle = hf_greedy(path, prompts)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=3)

    check_against_oracle([llm.generate([p], sp, use_tqdm=False)[0] for p in prompts], oracle, "one at a time")
    check_against_oracle(llm.generate(prompts, sp, use_tqdm=False), oracle, "batched")
    chunked = LLM(str(path), max_model_len=128, num_gpu_blocks_override=128, max_num_batched_tokens=16)
    check_against_oracle(chunked.generate(prompts, sp, use_tqdm=False), oracle, "chunked")
    # The bytes of 12 blocks of 8 tokens of every layer (K and V, 2 KV heads of 16, float32): one 96-token context.
    # With KV cache groups (the default) and without.
    kv_bytes = 12 * 6 * 2 * 8 * 2 * 16 * 4
    tight = LLM(str(path), max_model_len=96, kv_cache_memory_bytes=kv_bytes, block_size=8, max_num_batched_tokens=64)
    assert len(tight.engine.kv.group_windows) > 1
    check_against_oracle(tight.generate(prompts, sp, use_tqdm=False), oracle, "preempted")
    assert tight.engine.scheduler.num_preemptions > 0
    kept = LLM(str(path), max_model_len=96, num_gpu_blocks_override=12, block_size=8, max_num_batched_tokens=64,
               disable_hybrid_kv_cache_manager=True)
    check_against_oracle(kept.generate(prompts, sp, use_tqdm=False), oracle, "preempted, whole contexts")
    assert kept.engine.scheduler.num_preemptions > 0
    for engine in (llm.engine, chunked.engine, tight.engine, kept.engine):
        assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_gemma3_rejects_attn_softcapping(tmp_path):
    path = make_tiny_model(tmp_path / "m", "gemma3", attn_logit_softcapping=50.0)
    with pytest.raises(NotImplementedError, match="attn_logit_softcapping"):
        LLM(str(path), max_model_len=64, num_gpu_blocks_override=16)


def test_gemma3_missing_weight_is_named(tmp_path):
    from tokenmill.model.gemma3 import Gemma3ForCausalLM

    path = make_tiny_model(tmp_path / "m", "gemma3")
    cfg = load_hf_config(str(path))
    model = Gemma3ForCausalLM(cfg, dtype=torch.float32, compute_dtype=torch.float32, max_positions=64)
    from safetensors.torch import load_file

    weights = load_file(str(path / "model.safetensors"))
    weights.pop("model.layers.1.pre_feedforward_layernorm.weight")
    with pytest.raises(ValueError, match="layers.1.pre_feedforward_layernorm.weight"):
        model.load_weights(weights.items())
