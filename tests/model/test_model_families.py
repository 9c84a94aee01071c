"""Granite, OLMo 2, Phi-3 (and Phi-4-mini's rotary), Gemma 2 and GLM-4: greedy tokens and logprobs equal
transformers (the oracle) on tiny random models, batched, chunked by a 16-token budget (prompt chunks mixed with
decodes), again from the prefix cache, under a KV pool so small that requests are preempted, and over two
tensor-parallel ranks. Plus the settings each family refuses at load, and which of them run on the native
decoder stack."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_parity import NEW_TOKENS, check_against_oracle, hf_greedy, prompts_for
from tiny import _ARCH_DEFAULTS, build_tokenizer
from tokenmill import LLM, SamplingParams
from tokenmill.model.loader import load_hf_config
from tokenmill.model.native_stack import NativeStack

# Multipliers far from 1 (Granite 3 uses 12, 0.22, 1/128 and 8), so leaving one out changes the tokens.
GRANITE = dict(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0)
# Small caps so that they bind on these logits: attention scores reach a few units, logits ten or so.
GEMMA2 = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=24, attn_logit_softcapping=2.0,
              final_logit_softcapping=5.0, num_hidden_layers=4)

# Phi-3 128k's rope: short factors (head_dim 16: 8 of them, far from 1) while a context is within 256 tokens,
# and the attention factor of max_position_embeddings / original = 2.
PHI3_LONGROPE = dict(original_max_position_embeddings=256, rope_parameters={
    "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
    "long_factor": [2.0] * 8})

FAMILIES = {
    "granite": ("GraniteConfig", GRANITE),
    "olmo2": ("Olmo2Config", {}),
    "olmo2-mqa": ("Olmo2Config", {"num_key_value_heads": 1}),  # under TP=2 its one KV head is on both ranks
    "phi3": ("Phi3Config", {}),
    "phi3-longrope": ("Phi3Config", PHI3_LONGROPE),
    # Phi-4-mini's shape: LongRoPE on 3/4 of each head (12 of 16 features: 6 factors), the rest not rotated.
    "phi4mini-partial-longrope": ("Phi3Config", dict(PHI3_LONGROPE, rope_parameters=dict(
        PHI3_LONGROPE["rope_parameters"], partial_rotary_factor=0.75, short_factor=[1.0, 1.5, 2.0, 3.0, 4.0, 6.0],
        long_factor=[2.0] * 6), tie_word_embeddings=True)),
    "gemma2": ("Gemma2Config", GEMMA2),
    # Rotary on half of each head (GLM's default partial_rotary_factor), interleaved; q/k/v bias; fused gate_up.
    "glm": ("GlmConfig", {}),
    "glm4": ("Glm4Config", {}),  # and GLM-4-0414's four norms
}


def make_family_model(path: Path, config_class: str, seed: int = 0, **overrides) -> Path:
    """tests/tiny.py's make_tiny_model for a config class it does not build: the same sizes, tokenizer and
    weight scale, and every norm weight and bias made distinct."""
    import transformers as tf

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    cls = getattr(tf, config_class)  # getattr: the transformers config class by name
    config = cls(**dict(_ARCH_DEFAULTS, vocab_size=len(tok), **overrides))
    config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    config.bos_token_id = None
    config.pad_token_id = tok.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)  # peaked logits: greedy is not a coin toss
            else:  # norm weights and biases off their init (ones, zeros): a norm loaded in the wrong place shows
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [config.eos_token_id]}))
    return path


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_transformers(tmp_path, family):
    config_class, overrides = FAMILIES[family]
    path = make_family_model(tmp_path / family, config_class, **overrides)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=3)

    llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=128, block_size=16, enable_prefix_caching=True)
    prompts = prompts_for(llm.engine.vocab_size)
    oracle = hf_greedy(path, prompts)
    check_against_oracle(llm.generate(prompts, sp, use_tqdm=False), oracle, "batched")
    again = llm.generate(prompts, sp, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in again) > 0
    check_against_oracle(again, oracle, "prefix hit")
    chunked = LLM(str(path), max_model_len=128, num_gpu_blocks_override=128, max_num_batched_tokens=16)
    check_against_oracle(chunked.generate(prompts, sp, use_tqdm=False), oracle, "chunked")
    tight = LLM(str(path), max_model_len=96, num_gpu_blocks_override=12, block_size=8, max_num_batched_tokens=64,
                disable_hybrid_kv_cache_manager=True)
    check_against_oracle(tight.generate(prompts, sp, use_tqdm=False), oracle, "preempted")
    assert tight.engine.scheduler.num_preemptions > 0
    for engine in (llm.engine, chunked.engine, tight.engine):
        assert engine.kv.num_free_blocks == engine.kv.num_blocks


def _model(path: Path, **kw):
    from tokenmill.model.registry import resolve

    cfg = load_hf_config(str(path))
    return resolve(cfg.architectures)(cfg, dtype=torch.float32, compute_dtype=torch.float32, max_positions=64, **kw)


def test_family_layers_are_built_as_configured(tmp_path):
    granite = _model(make_family_model(tmp_path / "granite", "GraniteConfig", **GRANITE))
    assert granite.embed_scale == 4.0 and granite.logits_scaling == 2.0
    assert granite.layers[0].residual_multiplier == 0.5 and granite.layers[0].self_attn.attn.scale == 0.2
    # A Granite whose multipliers are all 1 is a Llama: nothing scaled.
    plain = _model(make_family_model(tmp_path / "granite1", "GraniteConfig", attention_multiplier=0.125))
    assert plain.embed_scale is None and plain.logits_scaling is None and plain.layers[0].residual_multiplier is None

    olmo = _model(make_family_model(tmp_path / "olmo2", "Olmo2Config"))
    attn = olmo.layers[0].self_attn
    assert attn.q_norm.weight.shape == (4 * 16,) and attn.k_norm.weight.shape == (2 * 16,)
    assert not hasattr(olmo.layers[0], "input_layernorm")

    gemma = _model(make_family_model(tmp_path / "gemma2", "Gemma2Config", **GEMMA2))
    assert [layer.self_attn.attn.sliding_window for layer in gemma.layers] == [24, None, 24, None]
    assert {layer.self_attn.attn.logits_soft_cap for layer in gemma.layers} == {2.0}
    assert gemma.final_logit_softcapping == 5.0 and gemma.layers[0].self_attn.attn.scale == 24**-0.5


def test_native_stack_takes_only_what_it_computes(tmp_path):
    """Phi-3 is a pre-norm Llama layer once loaded: the native stack runs it (and the parity test above then
    covers that path). Granite's multiplier and OLMo 2's norms are not in the C++ layer: Python runs them."""
    from tokenmill.model import native_stack

    if not native_stack.enabled():
        pytest.skip("native decoder stack not built here")
    assert NativeStack.why_not(_model(make_family_model(tmp_path / "phi3", "Phi3Config"))) is None
    config_class, overrides = FAMILIES["phi4mini-partial-longrope"]
    partial = make_family_model(tmp_path / "phi4mini", config_class, **overrides)
    assert NativeStack.why_not(_model(partial)) == "partial rotary"
    granite = _model(make_family_model(tmp_path / "granite", "GraniteConfig", **GRANITE))
    assert "residual multiplier" in NativeStack.why_not(granite)
    assert "post-norms" in NativeStack.why_not(_model(make_family_model(tmp_path / "olmo2", "Olmo2Config")))


def test_phi3_refuses_longrope_past_its_short_range_and_odd_partial_rotary(tmp_path):
    path = make_family_model(tmp_path / "long", "Phi3Config", **PHI3_LONGROPE)
    with pytest.raises(ValueError, match="longrope.*--max-model-len 256"):  # 512 by default: the long factors
        LLM(str(path), num_gpu_blocks_override=16)
    LLM(str(path), max_model_len=256, num_gpu_blocks_override=16)  # within the short factors' range
    partial = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    path = make_family_model(tmp_path / "partial", "Phi3Config", rope_parameters=partial)
    assert _model(path).layers[0].self_attn.rotary.rotary_dim == 8
    with open(path / "config.json") as f:
        cfg = json.load(f)
    cfg["rope_parameters"]["partial_rotary_factor"] = 0.1  # int(1.6) = 1 feature of 16: not an even count
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="partial_rotary_factor=0.1"):
        _model(path)


def test_phi3_missing_fused_weight_is_named(tmp_path):
    from safetensors.torch import load_file

    path = make_family_model(tmp_path / "phi3", "Phi3Config")
    weights = load_file(str(path / "model.safetensors"))
    assert "model.layers.0.self_attn.qkv_proj.weight" in weights and "model.layers.0.mlp.gate_up_proj.weight" in weights
    weights.pop("model.layers.1.mlp.gate_up_proj.weight")
    with pytest.raises(ValueError, match="layers.1.mlp.gate_up_proj.weight"):
        _model(path).load_weights(weights.items())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["gemma2", "glm4", "granite", "olmo2", "olmo2-mqa", "phi3"])
def test_tp2_equals_tp1(tmp_path, family):
    """Two ranks (gloo, one process each) give one rank's tokens and logprobs: Phi-3's fused qkv_proj and
    gate_up_proj split into each rank's heads and rows, Granite's scaled blocks and Gemma 2's capped attention
    over half the heads, GLM-4's interleaved half-head rotary, OLMo 2's q/k norms over all heads from each rank's
    slice (the sum of squares all-reduced; with one KV head, that head is on both ranks and counted once)."""
    from compare import assert_same_outputs

    config_class, overrides = FAMILIES[family]
    path = make_family_model(tmp_path / family, config_class, **overrides)
    prompts = prompts_for(384, seed=4)[:4]
    sp = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, logprobs=3)
    outs = []
    for tp in (1, 2):
        llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=64, tensor_parallel_size=tp)
        try:
            outs.append([o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)])
        finally:
            llm.engine.shutdown()
    assert_same_outputs(outs[0], outs[1], f"{family} tp=2", atol=1e-4)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bfloat16_weights_close_to_float32(tmp_path, family):
    """Stored in bfloat16 (the fused and Python paths' casts, Gemma 2's rounded embedding scale, GLM's reordering of
    rotary features): the first token's logprob stays near float32's."""
    config_class, overrides = FAMILIES[family]
    path = make_family_model(tmp_path / family, config_class, **overrides)
    prompts = prompts_for(384, seed=3)[:4]
    sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    f32 = LLM(str(path), dtype="float32", max_model_len=128, num_gpu_blocks_override=32)
    b16 = LLM(str(path), dtype="bfloat16", max_model_len=128, num_gpu_blocks_override=32)
    assert next(b16.engine.model.parameters()).dtype == torch.bfloat16
    for x, y in zip(f32.generate(prompts, sp, use_tqdm=False), b16.generate(prompts, sp, use_tqdm=False)):
        first = x.outputs[0].token_ids[0]
        top = y.outputs[0].logprobs[0]
        assert first in top, (family, first, sorted(top))  # float32's choice is among bfloat16's top 5
        assert abs(x.outputs[0].logprobs[0][first].logprob - top[first].logprob) < 0.1, family
