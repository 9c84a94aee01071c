"""LoRA adapters on the newer families (Phi-3, Gemma 2, OLMo 2, Granite, GLM-4, DeepSeek-V2/V3, gpt-oss) against
transformers + PEFT (the oracle) on the same tiny random weights: every adapter's greedy tokens and logprobs equal
PEFT's, mixed with the base model in one batch, again from the prefix cache and chunked by a 16-token budget.
The targets are PEFT's names as each checkpoint has them: Phi-3's fused qkv_proj and gate_up_proj (one A for the
whole fused layer), GLM-4's fused gate_up_proj beside its separate q/k/v, MLA's q_proj / q_a_proj / q_b_proj /
kv_a_proj_with_mqa / o_proj, gpt-oss's q/k/v/o (with the base's biases, under sliding windows). MLA's kv_b_proj
and LoRA on MoE experts (gpt-oss's router too) are refused at load, naming them."""
from __future__ import annotations

import pytest

from lora_tiny import ALL, make_adapter, no_failed_steps, peft_greedy  # noqa: F401 (an autouse fixture)
from test_deepseek import VARIANTS as DEEPSEEK
from test_deepseek import make_deepseek
from test_gpt_oss import make_gpt_oss
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
    # gpt-oss: q/k/v/o with their biases (the base's; PEFT adds none); the MoE block has no linear layer to adapt.
    "gpt-oss": (lambda path, _: make_gpt_oss(path), None, {}, ["q_proj", "k_proj", "v_proj", "o_proj"]),
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


def test_gpt_oss_adapter_with_drafts_equals_peft(tmp_path):
    """LoRA and speculation together on gpt-oss: n-gram drafts verified through the adapted q/k/v/o (the drafts'
    rows in the adapter's token runs), mixed with base requests, equal PEFT."""
    base = make_gpt_oss(tmp_path / "base", seed=4)
    adapter = make_adapter(base, tmp_path / "adapter", r=8, alpha=16, targets=CASES["gpt-oss"][3], seed=1, scale=0.2)
    prompts = prompts_for(384, seed=3)[1:7:2]
    oracle = {"adapter": peft_greedy(base, adapter, prompts, NEW_TOKENS), None: peft_greedy(base, None, prompts,
                                                                                             NEW_TOKENS)}
    assert [t for t, _ in oracle["adapter"]] != [t for t, _ in oracle[None]]
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=8, max_model_len=128,
              num_gpu_blocks_override=64, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                              "prompt_lookup_min": 1, "adaptive": False})
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts for _ in (0, 1)], sp, use_tqdm=False,
                        lora_request=[LoRARequest("adapter", 1, str(adapter)), None] * len(prompts))
    check_against_oracle(outs[0::2], oracle["adapter"], "gpt-oss drafts adapter")
    check_against_oracle(outs[1::2], oracle[None], "gpt-oss drafts base")
    assert llm.engine.core.scheduler.spec_stats.num_draft_tokens > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def peft_adapter(base, path, **lora) -> str:
    """A random PEFT adapter with LoraConfig(**lora): what make_adapter makes, for targets it does not take
    (target_parameters, "all-linear")."""
    import torch
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **lora))
    model.save_pretrained(path)
    return str(path)


def test_gpt_oss_expert_and_router_adapters_are_refused(tmp_path):
    """gpt-oss's experts are fused [E, H, 2I] tensors and its router a bare weight: PEFT adapts them through
    target_parameters (as gpt-oss fine-tunes do for the experts), which has no LoRA path here, so such an adapter
    is refused at load naming them; and so is one naming them as modules. PEFT's "all-linear" (q/k/v/o: the
    router is no nn.Linear) is served, equal to PEFT."""
    import json

    base = make_gpt_oss(tmp_path / "base")
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=8, max_model_len=64,
              num_gpu_blocks_override=16)
    sp = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4, logprobs=2)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]  # longer than the window of 8

    def refused(name: str, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False,
                         lora_request=LoRARequest(name, len(name), str(tmp_path / name)))
        assert llm.engine.num_unfinished_requests == 0

    peft_adapter(base, tmp_path / "experts", target_modules=["q_proj"],
                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    refused("experts", r"target_parameters \['mlp.experts.gate_up_proj', 'mlp.experts.down_proj'\].*expert")
    peft_adapter(base, tmp_path / "router", target_modules=[], target_parameters=["mlp.router.weight"])
    refused("router", r"target_parameters \['mlp.router.weight'\].*router")
    # The router's tensors as a module target (lora_A [r, H], lora_B [E, r], as a Linear router would have).
    cfg_file = tmp_path / "router" / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    (tmp_path / "router_module").mkdir()
    (tmp_path / "router_module" / "adapter_config.json").write_text(
        json.dumps(dict(cfg, target_modules=["router"], target_parameters=None)))
    (tmp_path / "router_module" / "adapter_model.safetensors").symlink_to(
        tmp_path / "router" / "adapter_model.safetensors")
    refused("router_module", r"target module 'router' is not supported \(a MoE router")

    good = peft_adapter(base, tmp_path / "all_linear", target_modules="all-linear")
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False,
                       lora_request=LoRARequest("all_linear", 1, good))
    check_against_oracle(out, peft_greedy(base, good, [prompt], 4), "all-linear")
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
