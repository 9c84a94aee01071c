"""GGUF base models with LoRA adapters: llama.cpp's GGUF LoRA format (Q/K rows in rope order, alpha in the
header, float or Q8_0 tensors) gives what the same adapter in PEFT form gives, and both equal transformers + PEFT;
a quantized base keeps its blocks and the adapter stays float."""
from __future__ import annotations

import pytest

from gguf_tiny import write_gguf
from lora_tiny import make_adapter, no_failed_steps, peft_greedy, write_gguf_lora  # noqa: F401 (autouse)
from test_parity import check_against_oracle, prompts_for
from tiny import make_tiny_model
from tokenmill import LLM, LoRARequest, SamplingParams

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-lora")
    hf = make_tiny_model(root / "hf", "llama")  # 4 heads, 2 KV heads: q and k permuted differently
    base = write_gguf(hf, root / "base.gguf")
    peft_dir = make_adapter(hf, root / "peft", r=8, alpha=16, seed=3)
    prompts = prompts_for(384, seed=5)[1:6:2]
    return root, hf, base, peft_dir, prompts, peft_greedy(hf, peft_dir, prompts, NEW_TOKENS)


@pytest.mark.parametrize("qtype", [None, "Q8_0"])
def test_gguf_lora_equals_peft_on_a_gguf_base(setup, qtype):
    import gguf

    root, hf, base, peft_dir, prompts, oracle = setup
    q = getattr(gguf.GGMLQuantizationType, qtype) if qtype else None
    lora_file = write_gguf_lora(peft_dir, root / f"lora-{qtype}.gguf", n_head=4, n_kv_head=2, qtype=q)
    llm = LLM(str(base), tokenizer=str(hf), enable_lora=True, max_lora_rank=8, max_model_len=128, num_gpu_blocks_override=64)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=2)
    ps = [{"prompt_token_ids": p} for p in prompts]
    from_peft = llm.generate(ps, sp, use_tqdm=False, lora_request=LoRARequest("peft", 1, str(peft_dir)))
    from_gguf = llm.generate(ps, sp, use_tqdm=False, lora_request=LoRARequest("gguf", 2, str(lora_file)))
    check_against_oracle(from_peft, oracle, "PEFT adapter on the GGUF base")
    if qtype is None:
        check_against_oracle(from_gguf, oracle, "GGUF adapter")
    else:  # Q8_0 rounds A (~0.4 % of a block's largest value): a near tie may flip, so compare the first step's
        # logprobs, within that rounding, instead of whole sequences
        for out, (_, logprobs) in zip(from_gguf, oracle):
            for tid, lp in out.outputs[0].logprobs[0].items():
                assert abs(lp.logprob - float(logprobs[0, tid])) < 0.01, (tid, lp.logprob, float(logprobs[0, tid]))


def test_quantized_gguf_base_keeps_its_blocks_and_applies_the_adapter(setup):
    import gguf

    root, hf, _, peft_dir, prompts, _ = setup
    q4 = write_gguf(hf, root / "base-q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    plain = LLM(str(q4), tokenizer=str(hf), max_model_len=128, num_gpu_blocks_override=64)
    llm = LLM(str(q4), tokenizer=str(hf), enable_lora=True, max_lora_rank=8, max_model_len=128, num_gpu_blocks_override=64)
    layer = llm.engine.runner.lora.targets.layers["layers.0.self_attn.qkv_proj"]
    assert type(layer.quant_method).__name__ == type(
        plain.engine.model.layers[0].self_attn.qkv_proj.quant_method).__name__ != "UnquantizedLinearMethod"
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    ps = [{"prompt_token_ids": p} for p in prompts]
    base_out = [o.outputs[0].token_ids for o in plain.generate(ps, sp, use_tqdm=False)]
    # The base requests of the LoRA engine equal the plain engine's; the adapter's differ from them.
    mixed = llm.generate(ps + ps, sp, use_tqdm=False,
                         lora_request=[None] * len(ps) + [LoRARequest("peft", 1, str(peft_dir))] * len(ps))
    assert [o.outputs[0].token_ids for o in mixed[: len(ps)]] == base_out
    assert [o.outputs[0].token_ids for o in mixed[len(ps):]] != base_out


def test_not_an_adapter_gguf_is_refused(setup):
    root, hf, base, _, _, _ = setup
    llm = LLM(str(base), tokenizer=str(hf), enable_lora=True, max_lora_rank=8, max_model_len=64, num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="not a LoRA adapter"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=LoRARequest("model", 1, str(base)))
