"""Greedy output and logits equal transformers (the oracle) on tiny random models, for every
Llama-family architecture, however the batch is formed: one at a time, all at once, chunked by a
16-token budget, and under a KV pool so small that requests are preempted."""
from __future__ import annotations

import pytest
import torch

from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams

NEW_TOKENS = 32
PROMPT_LENS = [3, 9, 14, 21, 30, 38, 47, 60]
LOGPROB_ATOL = 2e-4  # float32: differences are summation order only

VARIANTS = {
    "llama-gqa": ("llama", {}),
    "llama-mha": ("llama", {"num_key_value_heads": 4}),
    "llama-mqa-tied": ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                              "rope_theta": 500000.0}),
    "llama-linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-yarn-rope": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 128}}),
    "llama-dynamic-rope": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "mistral-sliding": ("mistral", {}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qknorm": ("qwen3", {}),
}


def prompts_for(vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Keep clear of the special tokens at the start of the vocabulary.
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_greedy(path, prompts):
    """transformers generate, greedy, with raw logits per step."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    results = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        tokens = out.sequences[0, len(p):].tolist()
        logprobs = torch.stack([torch.log_softmax(l[0].float(), -1) for l in out.logits])  # [steps, V]
        results.append((tokens, logprobs))
    return results


def check_against_oracle(outputs, oracle, label):
    for i, (out, (tokens, logprobs)) in enumerate(zip(outputs, oracle)):
        got = out.outputs[0].token_ids
        assert got == tokens, f"{label}: prompt {i} diverged from transformers at step " \
            f"{next(k for k, (a, b) in enumerate(zip(got, tokens)) if a != b)}"
        for step, entry in enumerate(out.outputs[0].logprobs):
            for tid, lp in entry.items():
                ref = float(logprobs[step, tid])
                assert abs(lp.logprob - ref) < LOGPROB_ATOL, f"{label}: prompt {i} step {step} token {tid}: {lp.logprob} vs {ref}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_and_logits_match_transformers(tmp_path, variant):
    arch, overrides = VARIANTS[variant]
    path = make_tiny_model(tmp_path / variant, arch, **overrides)
    llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=128, block_size=16)
    vocab = llm.engine.vocab_size
    prompts = prompts_for(vocab)
    oracle = hf_greedy(path, prompts)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=3)

    # (a) one request at a time
    one_by_one = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
    check_against_oracle(one_by_one, oracle, "one at a time")
    # (b) all at once
    check_against_oracle(llm.generate(prompts, sp, use_tqdm=False), oracle, "batched")
    # (c) a 16-token budget: prompts are chunked and mixed with decodes
    chunked = LLM(str(path), max_model_len=128, num_gpu_blocks_override=128, max_num_batched_tokens=16)
    check_against_oracle(chunked.generate(prompts, sp, use_tqdm=False), oracle, "chunked")
    # (d) a pool of 12 blocks of 8 tokens for 8 requests of up to 92 tokens: preemption must happen
    tight = LLM(str(path), max_model_len=96, num_gpu_blocks_override=12, block_size=8, max_num_batched_tokens=64)
    check_against_oracle(tight.generate(prompts, sp, use_tqdm=False), oracle, "preempted")
    assert tight.engine.scheduler.num_preemptions > 0
    for engine in (llm.engine, chunked.engine, tight.engine):
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        engine.kv.check_invariants()


def test_prefix_caching_off_and_n_sharing_match(tmp_path):
    path = make_tiny_model(tmp_path / "m", "llama")
    prompts = prompts_for(384, seed=2)
    sp = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, logprobs=2)
    on = LLM(str(path), max_model_len=128, num_gpu_blocks_override=64, enable_prefix_caching=True)
    off = LLM(str(path), max_model_len=128, num_gpu_blocks_override=64, enable_prefix_caching=False)
    shared = [p + [5, 6, 7] for p in prompts] + [prompts[-1] + [9, 9]]  # shared prefixes across requests
    a = on.generate(shared, sp, use_tqdm=False)
    b = off.generate(shared, sp, use_tqdm=False)
    a2 = on.generate(shared, sp, use_tqdm=False)  # second pass hits the cache
    assert any(o.num_cached_tokens > 0 for o in a2)
    for x, y, z in zip(a, b, a2):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids == z.outputs[0].token_ids
        for ex, ey in zip(x.outputs[0].logprobs, z.outputs[0].logprobs):
            for tid in ex:
                assert abs(ex[tid].logprob - ey[tid].logprob) < LOGPROB_ATOL
    # n > 1 greedy: every sequence is the same and the prompt's blocks are shared.
    out = on.generate([prompts[-1]], SamplingParams(n=3, temperature=0.0, max_tokens=8, min_tokens=8),
                      use_tqdm=False)[0]
    assert len(out.outputs) == 3 and len({tuple(o.token_ids) for o in out.outputs}) == 1
    assert on.engine.kv.num_free_blocks == on.engine.kv.num_blocks


def test_bfloat16_weights_close_to_float32(tmp_path):
    path = make_tiny_model(tmp_path / "m", "llama")
    prompts = prompts_for(384, seed=3)[:4]
    sp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1)
    f32 = LLM(str(path), dtype="float32", max_model_len=128, num_gpu_blocks_override=32).generate(prompts, sp, use_tqdm=False)
    b16 = LLM(str(path), dtype="bfloat16", max_model_len=128, num_gpu_blocks_override=32)
    assert next(b16.engine.model.parameters()).dtype == torch.bfloat16
    out = b16.generate(prompts, sp, use_tqdm=False)
    for x, y in zip(f32, out):
        first = x.outputs[0].token_ids[0]
        assert abs(x.outputs[0].logprobs[0][first].logprob - y.outputs[0].logprobs[0].get(first, x.outputs[0].logprobs[0][first]).logprob) < 0.1
