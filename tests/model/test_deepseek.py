"""DeepSeek-V2 and V3 (MLA over the latent KV cache, DeepSeekMoE): greedy tokens and logprobs equal transformers'
(the oracle) on tiny random checkpoints, batched, chunked by a 16-token budget (prompt chunks mixed with decodes),
again from the prefix cache and with a prompt that shares another's prefix, preempted, on every CPU attention
backend; the cache holds kv_lora_rank + qk_rope_head_dim values per token and layer (also quantized, through the
offload tiers and a prefill/decode transfer); the absorbed form equals the up-projected one; TP=2 (and expert
parallel) equals TP=1; the checkpoint's MTP layer drafts without changing the output."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_parity import NEW_TOKENS, check_against_oracle, hf_greedy, prompts_for
from tiny import _ARCH_DEFAULTS, build_tokenizer
from tokenmill import LLM, SamplingParams

MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
MOE = dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=32, n_group=4, topk_group=2)

VARIANTS = {
    # V2-Lite's shape: q_proj straight from the hidden state; softmax routing limited to 1 of 4 groups (with a
    # group's best expert as its score, 2 groups would always hold the top 2 experts); 2 shared experts.
    "v2": ("DeepseekV2Config", dict(MLA, **dict(MOE, topk_group=1), q_lora_rank=None, n_shared_experts=2,
                                    topk_method="group_limited_greedy", routed_scaling_factor=1.5)),
    # V3's: q through its low-rank pair; sigmoid + correction bias, renormalised; YaRN with mscale_all_dim.
    "v3": ("DeepseekV3Config", dict(MLA, **MOE, q_lora_rank=24, n_shared_experts=1, norm_topk_prob=True,
                                    routed_scaling_factor=2.5, rope_parameters={
                                        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 128, "beta_fast": 32.0,
                                        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})),
}


def make_deepseek(path: Path, config_class: str, seed: int = 0, **overrides) -> Path:
    """A tiny random checkpoint written by transformers (as test_model_families' make_family_model), with the
    router's correction bias off zero so that it changes the choice."""
    import transformers as tf

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    config = getattr(tf, config_class)(**dict(_ARCH_DEFAULTS, vocab_size=len(tok), **overrides))
    config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    config.bos_token_id = None
    config.pad_token_id = tok.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)  # peaked logits: greedy is not a coin toss
            else:  # norm weights off their init: a norm loaded in the wrong place shows
                p.add_(torch.randn_like(p) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [config.eos_token_id]}))
    return path


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    config_class, overrides = VARIANTS[request.param]
    path = make_deepseek(tmp_path_factory.mktemp(request.param), config_class, **overrides)
    return request.param, path, overrides


def test_deepseek_matches_transformers(variant):
    name, path, _ = variant
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=3)
    llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=64, block_size=16, enable_prefix_caching=True)
    prompts = prompts_for(llm.engine.vocab_size)
    # A prompt that shares the longest one's first 48 tokens (three full blocks) and then differs.
    prompts.append(prompts[-1][:48] + prompts[0])
    oracle = hf_greedy(path, prompts)
    first = llm.generate(prompts[:-1], sp, use_tqdm=False)
    check_against_oracle(first, oracle, f"{name} batched")
    shared = llm.generate(prompts[-1:], sp, use_tqdm=False)
    assert shared[0].num_cached_tokens == 48
    check_against_oracle(shared, oracle[-1:], f"{name} shared prefix")
    again = llm.generate(prompts, sp, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in again) > 0
    check_against_oracle(again, oracle, f"{name} prefix hit")
    # The torch reference backend too (the others ran on the CPU default, the native kernel).
    chunked = LLM(str(path), max_model_len=128, num_gpu_blocks_override=64, max_num_batched_tokens=16,
                  attention_backend="torch_sdpa")
    check_against_oracle(chunked.generate(prompts, sp, use_tqdm=False), oracle, f"{name} chunked")
    tight = LLM(str(path), max_model_len=96, num_gpu_blocks_override=12, block_size=8, max_num_batched_tokens=64)
    check_against_oracle(tight.generate(prompts, sp, use_tqdm=False), oracle, f"{name} preempted")
    assert tight.engine.scheduler.num_preemptions > 0
    for engine in (llm.engine, chunked.engine, tight.engine):
        assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_latent_cache_bytes_per_token(variant):
    """One latent of kv_lora_rank + qk_rope_head_dim values per token and layer; V shares K's tensor."""
    name, path, overrides = variant
    llm = LLM(str(path), max_model_len=64, num_gpu_blocks_override=8, block_size=16)
    runner = llm.engine.runner
    latent = overrides["kv_lora_rank"] + overrides["qk_rope_head_dim"]
    assert runner.bytes_per_block == 16 * overrides["num_hidden_layers"] * latent * 4  # float32
    for a in runner.attn_layers:
        assert a.v_cache is a.k_cache and a.k_cache.shape[-2:] == (1, latent)
    # The diagnostics' roofline reads the same bytes per token (and the absorbed form's score and sum widths).
    from tokenmill.diagnostics import ModelCost

    cost = ModelCost.from_model(llm.engine.model, llm.engine.model.config, runner.kv_dtype)
    assert cost.kv_bytes_per_token == overrides["num_hidden_layers"] * latent * 4


@pytest.mark.timeout(300)
def test_tp2_equals_tp1(variant):
    """Two ranks (gloo, one process each): each holds half the heads of q_proj / q_b_proj / kv_b_proj and o_proj's
    columns, caches the whole latent (kv_a_proj_with_mqa replicated), and a slice of every expert and shared
    expert, all-reduced once per block; with expert parallelism, half the experts whole."""
    from compare import assert_same_outputs

    name, path, _ = variant
    prompts = prompts_for(384, seed=4)[:4]
    sp = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, logprobs=3)
    outs = []
    for kw in ({}, dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, enable_expert_parallel=True)):
        llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=64, **kw)
        try:
            outs.append([o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)])
        finally:
            llm.engine.shutdown()
    assert_same_outputs(outs[0], outs[1], f"{name} tp=2", atol=1e-4)
    assert_same_outputs(outs[0], outs[2], f"{name} tp=2 ep", atol=1e-4)


@pytest.mark.parametrize("kv", ["float32", "int8", "fp8"])
def test_latent_cache_quantized_and_offloaded(variant, tmp_path, kv):
    """The latent cache quantized (int8: one scale per token's latent; fp8) and moved through the host and disk
    tiers: the same outputs as without offloading, loads from both tiers; a block is one latent per token."""
    import glob

    from test_prefix_caching import assert_same, params_for, sequential, stems_and_prompts

    name, path, overrides = variant
    prompts = stems_and_prompts(seed=1, stems=4, stem_len=40)
    params = params_for(prompts)
    kw = dict(max_model_len=96, num_gpu_blocks_override=14, block_size=8, kv_cache_dtype=kv)
    ref = sequential(LLM(str(path), enable_prefix_caching=False, **kw), prompts, params)
    latent = overrides["kv_lora_rank"] + overrides["qk_rope_head_dim"]
    per_slot = {"float32": 4 * latent, "int8": latent + 4, "fp8": latent}[kv]
    bpb = overrides["num_hidden_layers"] * 8 * per_slot
    llm = LLM(str(path), kv_offload_bytes=8 * bpb, kv_offload_dir=str(tmp_path / "kv"), kv_offload_min_blocks=1,
              **kw)
    transfer = llm.engine.transfer
    assert llm.engine.runner.bytes_per_block == transfer.bytes_per_block == bpb
    assert_same(sequential(llm, prompts, params), ref, f"{name} {kv} offload first pass")
    transfer.flush()
    assert glob.glob(str(tmp_path / "kv" / "*" / "*.kvb"))
    assert_same(sequential(llm, prompts, params), ref, f"{name} {kv} offload second pass")
    st = llm.engine.kv.offload.stats
    assert st.host_loads > 0 and st.disk_loads > 0 and st.load_failures == 0, st


def test_v3_rotate_half_rope(tmp_path):
    """rope_interleave false: V3's rope features rotated as halves (i, i + d/2), not pairs."""
    config_class, overrides = VARIANTS["v3"]
    path = make_deepseek(tmp_path / "v3-halves", config_class, **dict(overrides, rope_interleave=False))
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=3)
    llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=64, block_size=16)
    prompts = prompts_for(llm.engine.vocab_size)[:4]
    check_against_oracle(llm.generate(prompts, sp, use_tqdm=False), hf_greedy(path, prompts), "rotate-half")


def test_bfloat16_weights_close_to_float32(variant):
    """Stored in bfloat16 (kv_b_proj's blocks cast to the activations' dtype for the absorbed products): the
    first token's logprobs stay near float32's."""
    name, path, _ = variant
    prompts = prompts_for(384, seed=3)[:4]
    sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    f32 = LLM(str(path), dtype="float32", max_model_len=128, num_gpu_blocks_override=32)
    b16 = LLM(str(path), dtype="bfloat16", max_model_len=128, num_gpu_blocks_override=32)
    assert b16.engine.runner.attn_layers[0].k_cache.dtype == torch.bfloat16
    for a, b in zip(f32.generate(prompts, sp, use_tqdm=False), b16.generate(prompts, sp, use_tqdm=False)):
        top = a.outputs[0].logprobs[0]
        chosen = a.outputs[0].token_ids[0]
        assert abs(b.outputs[0].logprobs[0][b.outputs[0].token_ids[0]].logprob - top[chosen].logprob) < 0.1, name


def test_prefill_decode_transfer_of_the_latent_cache(variant, tmp_path):
    """Disaggregated prefill/decode through the shared-storage connector: the consumer loads the producer's latent
    blocks (one latent per token: the bytes moved are the latent cache's) and gives one engine's output."""
    from compare import assert_same_outputs

    name, path, _ = variant
    kw = dict(max_model_len=128, num_gpu_blocks_override=64, block_size=4)
    prompts = prompts_for(384, seed=5)[3:6]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2)
    ref = LLM(str(path), **kw).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    def transfer(role: str) -> dict:
        return {"kv_role": role, "kv_connector": "SharedStorageConnector",
                "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}

    producer = LLM(str(path), kv_transfer_config=transfer("kv_producer"), **kw)
    producer.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1), use_tqdm=False)
    consumer = LLM(str(path), kv_transfer_config=transfer("kv_consumer"), **kw)
    out = consumer.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(ref, out):
        assert_same_outputs(a.outputs, b.outputs, f"{name} pd")
    kt = consumer.engine.core.scheduler_stats().kv_transfer
    assert kt["imported_blocks"] > 10 and kt["import_failures"] == 0
    assert kt["bytes"] == kt["imported_blocks"] * consumer.engine.runner.bytes_per_block


def test_triton_backend(variant):
    """The Triton paged kernel (here under TRITON_INTERPRET=1) takes the latent as one KV head of a width that is
    no power of two (masked up to the next), V reading K's tensor."""
    name, path, _ = variant
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=3)
    llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=32, block_size=16,
              attention_backend="triton_paged")
    prompts = prompts_for(llm.engine.vocab_size)[1:2]
    check_against_oracle(llm.generate(prompts, sp, use_tqdm=False), hf_greedy(path, prompts), f"{name} triton")


def add_deepseek_mtp_layer(path: Path, seed: int = 0) -> None:
    """DeepSeek-V3's MTP layer model.layers.{N}.* (N = num_hidden_layers), as the released checkpoints hold it:
    enorm, hnorm, eh_proj, a decoder layer like the last (MLA + MoE; here its weights perturbed) and
    shared_head.norm; the embedding and LM head are the target's."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((path / "config.json").read_text())
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    w = load_file(str(path / "model.safetensors"))
    last, pre = f"model.layers.{n - 1}.", f"model.layers.{n}."
    for name in [k for k in w if k.startswith(last)]:
        t = w[name]
        w[pre + name[len(last):]] = t + 0.02 * torch.randn(t.shape, generator=g)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        w[f"{pre}{norm}.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    w[f"{pre}eh_proj.weight"] = 0.08 * torch.randn(h, 2 * h, generator=g)
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))


def test_mtp_layer_from_the_checkpoint_leaves_greedy_output_unchanged(variant, tmp_path):
    """`method: mtp` drafts with the checkpoint's own MTP layer (an MLA + MoE block with its own latent cache);
    verification keeps the output exactly the target's, chunked and batched."""
    import shutil

    from compare import assert_same_outputs

    name, path, _ = variant
    target = tmp_path / "mtp"
    shutil.copytree(path, target)
    add_deepseek_mtp_layer(target)
    prompts = [{"prompt_token_ids": p} for p in prompts_for(384, seed=6)[:4]]
    sp = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20, logprobs=2)
    kw = dict(max_model_len=128, num_gpu_blocks_override=64, max_num_batched_tokens=32)
    base = [o.outputs[0] for o in LLM(str(target), **kw).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(str(target), speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **kw)
    out = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert_same_outputs(base, out, f"{name} mtp")
    st = llm.engine.core.scheduler.spec_stats
    assert st.num_draft_tokens > 0
    head_layers = llm.engine.runner.spec.runner.attn_layers
    assert head_layers and all(a.kv_shared for a in head_layers)


def up_projected_reference(attn, x: torch.Tensor) -> torch.Tensor:
    """The MLA layer as transformers computes it, over a whole sequence [T, hidden]: per-head K = [W_UK c_kv, k_pe],
    V = W_UV c_kv up-projected from the latents, causal attention, o_proj (dense, float32, no cache)."""
    m, H, T = attn.mla, attn.num_heads, x.shape[0]
    dn, dr, r = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
    q = attn.q_proj(x) if m.q_lora_rank is None else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    q_nope, q_pe = q.view(T, H, dn + dr).split([dn, dr], dim=-1)
    c_kv, k_pe = attn.kv_a_proj_with_mqa(x).split([r, dr], dim=-1)
    c_kv = attn.kv_a_layernorm(c_kv.contiguous())
    q_pe, k_pe = attn.rotary(torch.arange(T), q_pe.contiguous(), k_pe.reshape(T, 1, dr).contiguous())
    kv = (c_kv @ attn.kv_b_proj.weight.T).view(T, H, dn + m.v_head_dim)
    k = torch.cat([kv[..., :dn], k_pe.expand(T, H, dr)], dim=-1).transpose(0, 1)  # [H, T, dn + dr]
    v = kv[..., dn:].transpose(0, 1)  # [H, T, v]
    qh = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)
    o = torch.nn.functional.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=attn.attn.scale)
    return attn.o_proj(o.transpose(0, 1).reshape(T, H * m.v_head_dim))


@torch.inference_mode()
@pytest.mark.parametrize("backend", ["cpu_paged", "torch_sdpa"])
def test_absorbed_form_over_the_latent_cache_equals_the_up_projected_form(variant, backend):
    """One MLA layer: a 21-token prompt chunk, then decodes one token at a time, each attending in the absorbed
    form over the latents in a paged cache (blocks out of order), equal to the up-projected dense attention over
    the whole sequence to float32 tolerance."""
    from draft_heads_tiny import PagedSequence
    from tokenmill.layers.attention_backends import available_backends
    from tokenmill.model.loader import load_model

    if backend not in available_backends("cpu"):
        pytest.skip(f"{backend} is not built here")
    name, path, _ = variant
    attn = load_model(str(path), dtype="float32")[0].layers[1].self_attn
    x = torch.randn(29, attn.o_proj.output_size, generator=torch.Generator().manual_seed(2))
    ref = up_projected_reference(attn, x)
    seq = PagedSequence([attn.attn], num_blocks=12, block_size=4, backend=backend)
    chunks = [21] + [1] * 8
    got, start = [], 0
    for n in chunks:
        got.append(attn(torch.arange(start, start + n), x[start:start + n], seq.meta(start, n)))
        start += n
    torch.testing.assert_close(torch.cat(got), ref, atol=2e-5, rtol=1e-4)
