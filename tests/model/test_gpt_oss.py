"""gpt-oss (attention sinks, alternating sliding-window / full layers, YaRN, the router with bias and the clamped
SwiGLU experts): greedy tokens and logprobs equal transformers' (the oracle, eager attention) on a tiny random
checkpoint, batched, from the prefix cache and with a prompt that shares another's prefix, chunked by a 16-token
budget, preempted (torch_sdpa), batched and chunked on cpu_paged and triton_paged; TP=2 equals TP=1; decode and
prefill context parallelism on two ranks; a backend without sinks refuses the model at load."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_parity import NEW_TOKENS, check_against_oracle, hf_greedy, prompts_for
from tiny import build_tokenizer
from tokenmill import LLM, SamplingParams

# Windows of 8 under prompts of up to 60 tokens: the sliding layers really drop keys; the swiglu limit low
# enough that the clamps bite on these random weights.
CONFIG = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
              max_position_embeddings=256, swiglu_limit=1.5,
              rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})


def make_gpt_oss(path: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random gpt-oss checkpoint written by transformers, every bias and sink off zero."""
    import transformers as tf

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    config = tf.GptOssConfig(**dict(CONFIG, vocab_size=len(tok), **overrides))
    config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    config.bos_token_id = None
    config.pad_token_id = tok.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn_like(p))  # logits of the order of the scores': the sink takes a real share
            elif p.dim() >= 2:
                p.normal_(0.0, 0.08)  # peaked logits: greedy is not a coin toss
            else:  # norm weights and biases off their init: one loaded in the wrong place shows
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [config.eos_token_id]}))
    return path


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return make_gpt_oss(tmp_path_factory.mktemp("gpt_oss"))


def test_gpt_oss_matches_transformers(gpt_oss):
    path = gpt_oss
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=3)
    llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=64, block_size=16, enable_prefix_caching=True,
              attention_backend="torch_sdpa")
    prompts = prompts_for(llm.engine.vocab_size)
    prompts.append(prompts[-1][:48] + prompts[0])  # shares the longest one's first three blocks
    oracle = hf_greedy(path, prompts)
    check_against_oracle(llm.generate(prompts[:-1], sp, use_tqdm=False), oracle, "batched")
    shared = llm.generate(prompts[-1:], sp, use_tqdm=False)
    assert shared[0].num_cached_tokens > 0
    check_against_oracle(shared, oracle[-1:], "shared prefix")
    again = llm.generate(prompts, sp, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in again) > 0
    check_against_oracle(again, oracle, "prefix hit")
    chunked = LLM(str(path), max_model_len=128, num_gpu_blocks_override=64, max_num_batched_tokens=16,
                  attention_backend="torch_sdpa")
    check_against_oracle(chunked.generate(prompts, sp, use_tqdm=False), oracle, "chunked")
    # The bytes of 12 blocks of 8 tokens of every layer (K and V, 2 KV heads of 16, float32): one 96-token context,
    # shared by the sliding and the full layers' cache groups.
    tight = LLM(str(path), max_model_len=96, kv_cache_memory_bytes=12 * 4 * 2 * 8 * 2 * 16 * 4, block_size=8,
                max_num_batched_tokens=64, attention_backend="torch_sdpa")
    assert len(tight.engine.kv.group_windows) > 1
    check_against_oracle(tight.generate(prompts, sp, use_tqdm=False), oracle, "preempted")
    assert tight.engine.scheduler.num_preemptions > 0
    for engine in (llm.engine, chunked.engine, tight.engine):
        assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("backend", ["cpu_paged", pytest.param("triton_paged", marks=pytest.mark.slow)])
def test_other_attention_backends(gpt_oss, backend):
    """The native CPU kernel (the CPU default) and Triton under the interpreter, batched and chunked."""
    from tokenmill.layers.attention_backends import available_backends

    if backend not in available_backends("cpu"):
        pytest.skip(f"{backend} is not available here")
    prompts = prompts_for(384)[2:5]  # 14 to 30 tokens: chunked by the budget of 16
    oracle = hf_greedy(gpt_oss, prompts)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=3)
    for kw in ({}, dict(max_num_batched_tokens=16)):
        llm = LLM(str(gpt_oss), max_model_len=128, num_gpu_blocks_override=64, attention_backend=backend, **kw)
        check_against_oracle(llm.generate(prompts, sp, use_tqdm=False), oracle, f"{backend} {kw}")


def test_sinks_and_windows_are_in_the_model(gpt_oss):
    """The layers carry the checkpoint's sinks and alternate windows as layer_types says (a model that dropped
    either would still run; the parity test above is what shows they are applied)."""
    from safetensors.torch import load_file

    llm = LLM(str(gpt_oss), max_model_len=64, num_gpu_blocks_override=16, attention_backend="torch_sdpa")
    layers = llm.engine.runner.attn_layers
    assert [a.sliding_window for a in layers] == [8, None, 8, None]
    tensors = load_file(str(next(gpt_oss.glob("*.safetensors"))))
    for i, a in enumerate(layers):
        assert torch.equal(a.sinks, tensors[f"model.layers.{i}.self_attn.sinks"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp2_equals_tp1(gpt_oss):
    """Two ranks: half the heads (and their sinks), half of every expert's intermediate dimension (gate and up
    de-interleaved before the cut), the down bias added once; and with expert parallelism, half the experts whole on
    each rank (each adding its own experts' down biases)."""
    from compare import assert_same_outputs

    prompts = prompts_for(384, seed=4)[:4]
    sp = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, logprobs=3)
    outs = []
    for kw in ({}, dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, enable_expert_parallel=True)):
        llm = LLM(str(gpt_oss), max_model_len=128, num_gpu_blocks_override=64, attention_backend="torch_sdpa", **kw)
        try:
            outs.append([o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)])
        finally:
            llm.engine.shutdown()
    assert_same_outputs(outs[0], outs[1], "gpt-oss tp=2", atol=1e-4)
    assert_same_outputs(outs[0], outs[2], "gpt-oss tp=2 ep", atol=1e-4)


def test_backend_without_sinks_refuses(gpt_oss):
    from test_attention_sinks import NoSinksBackend

    llm = LLM(str(gpt_oss), max_model_len=64, num_gpu_blocks_override=16, attention_backend="torch_sdpa")
    with pytest.raises(ValueError, match="no attention sinks"):
        NoSinksBackend(16, torch.device("cpu")).allocate_kv_cache(llm.engine.runner.attn_layers, 4, torch.float32)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallel_equals_transformers(gpt_oss, mode):
    """Two ranks holding half the blocks each (and, prefill, half the step's tokens): the sinks join the merged
    softmax once; KV cache groups for the sliding layers."""
    prompts = prompts_for(384)[2:6]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=3)
    llm = LLM(str(gpt_oss), max_model_len=128, block_size=8, num_gpu_blocks_override=100, max_num_batched_tokens=32,
              **{mode: 2})
    try:
        check_against_oracle(llm.generate(prompts, sp, use_tqdm=False), hf_greedy(gpt_oss, prompts), mode)
    finally:
        llm.engine.shutdown()


def test_experts_in_another_quantization_are_refused_at_load(gpt_oss):
    """The expert kernels read float or MXFP4 weights: int8 at load is refused, naming gpt-oss's experts."""
    with pytest.raises(ValueError, match="gpt-oss experts with 'int8' quantization are not supported"):
        LLM(str(gpt_oss), max_model_len=64, num_gpu_blocks_override=16, quantization="int8")
