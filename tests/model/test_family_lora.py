"""LoRA adapters on the newer families (Phi-3, Gemma 2, OLMo 2, Granite, GLM-4, DeepSeek-V2/V3) against
transformers + PEFT (the oracle) on the same tiny random weights: every adapter's greedy tokens and logprobs equal
PEFT's, mixed with the base model in one batch, again from the prefix cache and chunked by a 16-token budget.
The targets are PEFT's names as each checkpoint has them: Phi-3's fused qkv_proj and gate_up_proj (one A for the
whole fused layer), GLM-4's fused gate_up_proj beside its separate q/k/v, MLA's q_proj / q_a_proj / q_b_proj /
kv_a_proj_with_mqa / o_proj. MLA's kv_b_proj and LoRA on MoE experts are refused at load, naming them."""
from __future__ import annotations

import pytest

from lora_tiny import ALL, make_adapter, no_failed_steps, peft_greedy  # noqa: F401 (an autouse fixture)
from test_deepseek import VARIANTS as DEEPSEEK
from test_deepseek import make_deepseek
from test_model_families import FAMILIES, make_family_model
from test_parity import check_against_oracle, prompts_for
from tokenmill import LLM, LoRARequest, SamplingParams

NEW_TOKENS = 10
# MLA's linear projections. PEFT (0.21, transformers 5) turns gate_proj / up_proj / down_proj targets of a MoE
# model into LoRA on the fused expert tensors (target_parameters), which is refused below.
MLA_COMMON = ["kv_a_proj_with_mqa", "o_proj"]

# family -> (builder, config class, overrides, PEFT target_modules)
CASES = {
    "phi3": (make_family_model, *FAMILIES["phi3"], ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "glm4": (make_family_model, *FAMILIES["glm4"], ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj",
                                                    "down_proj"]),
    "gemma2": (make_family_model, *FAMILIES["gemma2"], ALL),
    "olmo2": (make_family_model, *FAMILIES["olmo2"], ALL),
    "granite": (make_family_model, *FAMILIES["granite"], ALL),
    "deepseek-v2": (make_deepseek, *DEEPSEEK["v2"], ["q_proj", *MLA_COMMON]),
    "deepseek-v3": (make_deepseek, *DEEPSEEK["v3"], ["q_a_proj", "q_b_proj", *MLA_COMMON]),
}


@pytest.mark.parametrize("family", sorted(CASES))
def test_adapter_equals_peft(tmp_path, family):
    build, config_class, overrides, targets = CASES[family]
    base = build(tmp_path / "base", config_class, **overrides)
    adapter = make_adapter(base, tmp_path / "adapter", r=8, alpha=16, targets=targets, seed=1, scale=0.2)
    prompts = prompts_for(384, seed=3)[1:7:2]  # 9, 21, 38 tokens
    oracle = {"adapter": peft_greedy(base, adapter, prompts, NEW_TOKENS), None: peft_greedy(base, None, prompts,
                                                                                             NEW_TOKENS)}
    # The adapter moves the output: a test that passed with the adapter ignored would not be one.
    assert [t for t, _ in oracle["adapter"]] != [t for t, _ in oracle[None]]
    lora = LoRARequest("adapter", 1, str(adapter))
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=2)
    ps = [{"prompt_token_ids": p} for p in prompts for _ in (0, 1)]
    loras = [lora, None] * len(prompts)

    def check(llm, label):
        outs = llm.generate(ps, sp, use_tqdm=False, lora_request=loras)
        check_against_oracle(outs[0::2], oracle["adapter"], f"{family} {label} adapter")
        check_against_oracle(outs[1::2], oracle[None], f"{family} {label} base")
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
        return outs

    llm = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=8, max_model_len=128,
              num_gpu_blocks_override=64, block_size=16, enable_prefix_caching=True)
    check(llm, "mixed")
    again = check(llm, "prefix hit")
    assert sum(o.num_cached_tokens for o in again) > 0
    chunked = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=8, max_model_len=128,
                  num_gpu_blocks_override=64, max_num_batched_tokens=16)
    check(chunked, "chunked")


def test_mla_kv_b_proj_and_expert_adapters_are_refused(tmp_path):
    """PEFT can adapt kv_b_proj, but the absorbed form never runs it as a linear layer; and the experts' fused
    tensors have no LoRA path: both refused naming them, and the engine goes on serving."""
    config_class, overrides = DEEPSEEK["v3"]
    base = make_deepseek(tmp_path / "base", config_class, **overrides)
    bad = make_adapter(base, tmp_path / "kvb", r=4, alpha=8, targets=["kv_b_proj", "o_proj"])
    good = make_adapter(base, tmp_path / "good", r=4, alpha=8, targets=["o_proj"])
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=8, max_model_len=64,
              num_gpu_blocks_override=16)
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    prompt = [{"prompt_token_ids": [5, 6, 7, 8]}]
    with pytest.raises(ValueError, match="kv_b_proj.*absorbed"):
        llm.generate(prompt, sp, use_tqdm=False, lora_request=LoRARequest("kvb", 1, str(bad)))
    assert llm.engine.num_unfinished_requests == 0
    experts = make_adapter(base, tmp_path / "experts", r=4, alpha=8, targets=["gate_proj", "up_proj", "down_proj"])
    with pytest.raises(ValueError, match="target_parameters.*expert"):
        llm.generate(prompt, sp, use_tqdm=False, lora_request=LoRARequest("experts", 3, str(experts)))
    assert llm.engine.num_unfinished_requests == 0
    out = llm.generate(prompt, sp, use_tqdm=False, lora_request=LoRARequest("good", 2, str(good)))
    assert len(out[0].outputs[0].token_ids) == 4


def test_phi3_adapter_for_the_unfused_names_is_refused(tmp_path):
    """Phi-3's checkpoint has no q_proj: an adapter naming one (made for a Llama of the same sizes) is refused."""
    from tiny import make_tiny_model

    config_class, overrides = FAMILIES["phi3"]
    base = make_family_model(tmp_path / "phi3", config_class, **overrides)
    llama = make_tiny_model(tmp_path / "llama", "llama")
    wrong = make_adapter(llama, tmp_path / "wrong", r=4, alpha=8, targets=["q_proj"])
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=8, max_model_len=64,
              num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="q_proj, which this model does not have"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=LoRARequest("wrong", 1, str(wrong)))
