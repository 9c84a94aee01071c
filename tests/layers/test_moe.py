"""Mixture-of-experts: the router, the grouped FusedMoE layer (against a per-token loop, per-expert vs merged
loading, tensor-parallel shards, int8/int4 experts), greedy parity with transformers for Mixtral,
Qwen2-MoE (shared expert) and Qwen3-MoE in the parity test's modes, GGUF round trips and int8 experts'
top-1 agreement."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gguf_tiny import LAYER_NAMES, add_common_header, permute
from test_parity import NEW_TOKENS, check_against_oracle, hf_greedy, prompts_for
from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams, native
from tokenmill.layers.moe import FusedMoE, Int4MoEMethod, Int8MoEMethod, expert_target, route

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {arch: make_tiny_model(root / arch, arch) for arch in ARCHS}


# ---- router ---------------------------------------------------------------------------------------
def test_route_topk_and_renormalisation():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, -1.0, 4.0, 4.5]])
    w, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2], [3, 2]]
    assert torch.allclose(w, probs.gather(1, ids))
    wn, idn = route(logits, 2, renormalize=True)
    assert torch.equal(idn, ids)
    assert torch.allclose(wn.sum(-1), torch.ones(2))
    # Mixtral's router: a softmax over the top-k logits is the renormalised top-k of the full softmax.
    assert torch.allclose(wn, torch.softmax(logits.gather(1, ids), -1), atol=1e-6)


def test_route_ties():
    w, ids = route(torch.zeros(3, 6), 2, renormalize=True)
    assert all(len(set(r)) == 2 for r in ids.tolist())  # k distinct experts even when all tie
    assert torch.allclose(w, torch.full((3, 2), 0.5))
    w, ids = route(torch.tensor([[2.0, 2.0, 1.0, 2.0]]), 2, renormalize=False)
    assert set(ids[0].tolist()) <= {0, 1, 3} and torch.allclose(w, torch.full((1, 2), w[0, 0].item()))


def test_expert_target_names():
    assert expert_target("layers.0.mlp.experts.3.up_proj.weight") == ("layers.0.mlp.experts.w13_weight", (3, "w3"))
    assert expert_target("layers.1.mlp.experts.0.w2.weight") == ("layers.1.mlp.experts.w2_weight", (0, "w2"))
    assert expert_target("layers.1.mlp.experts.gate_proj.weight") == ("layers.1.mlp.experts.w13_weight", (None, "w1"))
    assert expert_target("layers.1.mlp.shared_expert.gate_proj.weight") is None


# ---- the layer ------------------------------------------------------------------------------------
E, H, I = 6, 64, 32


def _experts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(I, H, generator=g) * 0.1, torch.randn(I, H, generator=g) * 0.1,
             torch.randn(H, I, generator=g) * 0.1) for _ in range(E)]


def _reference(x, weights, ids, experts):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            w1, w3, w2 = experts[int(ids[t, j])]
            out[t] += weights[t, j] * (F.silu(x[t] @ w1.T) * (x[t] @ w3.T)) @ w2.T
    return out


def _layer(experts, merged=False, tp_rank=0, tp_size=1, method=None):
    layer = FusedMoE(E, H, I, tp_rank=tp_rank, tp_size=tp_size, reduce_results=False)
    if method is not None:
        layer.quant_method = method
    if merged:
        for k, i in (("w1", 0), ("w3", 1), ("w2", 2)):
            param = layer.w2_weight if k == "w2" else layer.w13_weight
            layer.weight_loader(param, torch.stack([ex[i] for ex in experts]), (None, k))
    else:
        for e, (w1, w3, w2) in enumerate(experts):
            layer.weight_loader(layer.w13_weight, w1, (e, "w1"))
            layer.weight_loader(layer.w13_weight, w3, (e, "w3"))
            layer.weight_loader(layer.w2_weight, w2, (e, "w2"))
    assert layer.unloaded() == []
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _inputs(T=9, k=2):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g)
    w, ids = route(torch.randn(T, E, generator=g), k, renormalize=False)
    ids[0] = torch.tensor([5, 0])  # expert 5 and 0 active; some experts idle
    return x, w, ids


def test_fused_moe_matches_per_token_loop_and_merged_loading():
    experts = _experts()
    x, w, ids = _inputs()
    ref = _reference(x, w, ids, experts)
    assert torch.allclose(_layer(experts)(x, w, ids), ref, atol=1e-5)
    assert torch.allclose(_layer(experts, merged=True)(x, w, ids), ref, atol=1e-5)
    one = _layer(experts)(x[:1], w[:1], ids[:1])  # decode: a single token
    assert torch.allclose(one, ref[:1], atol=1e-5)


@pytest.mark.parametrize("grouped", ["1", "0"])
def test_grouped_and_per_expert_gemm_paths_agree(monkeypatch, grouped):
    """Few tokens per expert take the native grouped kernel; many (a prefill) the per-expert SGEMMs."""
    monkeypatch.setenv("TOKENMILL_MOE_GROUPED", grouped)
    experts = _experts()
    for T in (9, 80):  # 80 x 2 over 6 experts: more than GROUPED_MAX_ROWS tokens per expert
        x, w, ids = _inputs(T)
        assert torch.allclose(_layer(experts)(x, w, ids), _reference(x, w, ids, experts), atol=1e-5)


def test_the_cpu_grouped_kernel_is_never_chosen_off_the_cpu():
    """Issue 31: the native grouped kernel is a CPU kernel; a float MoE layer on another device takes the
    per-expert GEMMs (tested with tensors on the meta device, which has no kernels of tokenmill's)."""
    from tokenmill.layers.moe import _grouped

    layer = _layer(_experts())
    x = torch.zeros(4, layer.w13_weight.shape[-1])
    assert _grouped(layer, x, [1, 1]) == native.has_op("grouped_linear")
    assert not _grouped(layer, x.to("meta"), [1, 1])


@pytest.mark.skipif(not native.has_op("grouped_linear"), reason="native kernels not built")
@pytest.mark.parametrize("K, N, counts", [(512, 96, [8, 7, 9, 0, 8, 8, 10, 6]), (67, 37, [1, 2, 3, 0, 5]),
                                          (64, 128, [0, 0, 1]), (16, 5, [0, 0])])
def test_grouped_linear_equals_one_linear_per_expert(K, N, counts):
    g = torch.Generator().manual_seed(K)
    x, w = torch.randn(sum(counts), K, generator=g), torch.randn(len(counts), N, K, generator=g)
    y = torch.ops.tokenmill.grouped_linear(x, w, torch.tensor(counts))
    ref = torch.cat([F.linear(xs, w[e]) for e, xs in enumerate(torch.split(x, counts))])
    assert y.shape == (sum(counts), N) and torch.allclose(y, ref, atol=1e-4)
    with pytest.raises(RuntimeError, match="sum"):
        torch.ops.tokenmill.grouped_linear(x, w, torch.tensor([c + 1 for c in counts]))


def test_tensor_parallel_shards_sum_to_the_full_output():
    experts = _experts()
    x, w, ids = _inputs()
    parts = [_layer(experts, merged=r == 1, tp_rank=r, tp_size=2) for r in range(2)]
    assert parts[0].w13_weight.shape == (E, I, H) and parts[0].w2_weight.shape == (E, H, I // 2)
    assert torch.allclose(sum(p(x, w, ids) for p in parts), _reference(x, w, ids, experts), atol=1e-5)


def test_missing_expert_is_named():
    layer = FusedMoE(E, H, I, prefix="layers.0.mlp.experts")
    layer.weight_loader(layer.w13_weight, torch.zeros(E, I, H), (None, "w1"))
    assert "layers.0.mlp.experts.0.up_proj.weight" in layer.unloaded()
    with pytest.raises(ValueError, match="expected"):
        layer.weight_loader(layer.w2_weight, torch.zeros(I, H), (0, "w2"))


@pytest.mark.parametrize("method", [Int8MoEMethod(), Int4MoEMethod(32, False)], ids=["int8", "int4"])
def test_quantized_experts_close(method):
    experts = _experts()
    x, w, ids = _inputs()
    layer = _layer(experts, method=method)
    assert not hasattr(layer, "w13_weight") and layer.w13_qweight.shape[0] == E
    ref = _reference(x, w, ids, experts)
    tol = 0.02 if isinstance(method, Int8MoEMethod) else 0.2
    assert (layer(x, w, ids) - ref).abs().max() / ref.abs().max() < tol
    assert (layer(x[:1], w[:1], ids[:1]) - ref[:1]).abs().max() / ref[:1].abs().max() < tol


# ---- whole models against transformers ------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_parity_with_transformers(paths, arch):
    path = paths[arch]
    prompts = prompts_for(384)
    oracle = hf_greedy(path, prompts)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=3)
    llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=128, block_size=16)
    one_by_one = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts[:3]]  # batch-1 decode path
    check_against_oracle(one_by_one, oracle[:3], f"{arch} one at a time")
    check_against_oracle(llm.generate(prompts, sp, use_tqdm=False), oracle, f"{arch} batched")
    chunked = LLM(str(path), max_model_len=128, num_gpu_blocks_override=128, max_num_batched_tokens=16)
    check_against_oracle(chunked.generate(prompts, sp, use_tqdm=False), oracle, f"{arch} chunked")
    tight = LLM(str(path), max_model_len=96, num_gpu_blocks_override=12, block_size=8, max_num_batched_tokens=64)
    check_against_oracle(tight.generate(prompts, sp, use_tqdm=False), oracle, f"{arch} preempted")
    assert tight.engine.scheduler.num_preemptions > 0


def test_qwen2_moe_dense_layers(tmp_path):
    """mlp_only_layers / decoder_sparse_step: those layers get the dense MLP of intermediate_size."""
    path = make_tiny_model(tmp_path / "m", "qwen2_moe", mlp_only_layers=[0])
    llm = LLM(str(path), max_model_len=64, num_gpu_blocks_override=16)
    from tokenmill.model.moe_block import MoEBlock

    assert [type(layer.mlp).__name__ for layer in llm.engine.model.layers] == ["MLPBlock", MoEBlock.__name__]
    prompts = prompts_for(384)[:3]
    sp = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, logprobs=3)
    oracle = [(t[:8], lp[:8]) for t, lp in hf_greedy(path, prompts)]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    for o in outs:
        o.outputs[0].token_ids = o.outputs[0].token_ids[:8]
    check_against_oracle(outs, oracle, "qwen2_moe mlp_only_layers")


# ---- GGUF -----------------------------------------------------------------------------------------
def write_moe_gguf(folder: Path, out: Path, legacy: bool = False, qtype=None) -> Path:
    """The tiny MoE folder as llama.cpp lays it out: Mixtral as arch "llama" with an expert count (Q/K rows
    permuted), merged [E, ...] ffn_*_exps tensors (or, `legacy`, one ffn_gate.E tensor per expert); `qtype`
    (a gguf-py quantizable type) for the expert tensors, else float32."""
    import gguf
    import transformers as tf
    from safetensors.torch import load_file

    cfg = tf.AutoConfig.from_pretrained(folder)
    arch = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[cfg.model_type]
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(out), arch)
    add_common_header(w, cfg)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch != "llama":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    names = dict(LAYER_NAMES, post_attention_layernorm="ffn_norm", **{
        "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
        "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
        "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"})
    proj = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
    stacks: dict[str, list] = {}
    for name, t in load_file(str(folder / "model.safetensors")).items():
        a = t.float().numpy()
        top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
        if name in top:
            w.add_tensor(top[name], a)
            continue
        parts = name.split(".")
        i, rest, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
        if ".experts." in name:
            e, p = parts[-3], proj[parts[-2]]
            if legacy:
                w.add_tensor(f"blk.{i}.ffn_{p}.{e}.weight", a)
            else:
                stacks.setdefault(f"blk.{i}.ffn_{p}_exps.weight", [None] * experts)[int(e)] = a
            continue
        if arch == "llama" and kind == "weight" and rest in ("self_attn.q_proj", "self_attn.k_proj"):
            a = permute(a, cfg.num_attention_heads if rest.endswith("q_proj") else cfg.num_key_value_heads)
        if rest == "mlp.shared_expert_gate":
            a = a.reshape(-1)
        w.add_tensor(f"blk.{i}.{names[rest]}.{kind}", np.ascontiguousarray(a))
    for g, arrays in stacks.items():
        a = np.ascontiguousarray(np.stack(arrays))
        if qtype is None:
            w.add_tensor(g, a)
        else:
            q = gguf.quants.quantize(a, qtype)
            w.add_tensor(g, q, raw_shape=q.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize("arch,legacy", [("mixtral", False), ("mixtral", True), ("qwen2_moe", False),
                                         ("qwen3_moe", False)])
def test_gguf_round_trip_matches_safetensors(paths, tmp_path, arch, legacy):
    pytest.importorskip("gguf")
    folder = paths[arch]
    path = write_moe_gguf(folder, tmp_path / f"{arch}.gguf", legacy)
    prompts = prompts_for(384, seed=5)[:4]
    sp = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, logprobs=2)
    ref = LLM(str(folder), max_model_len=128, num_gpu_blocks_override=64).generate(prompts, sp, use_tqdm=False)
    got = LLM(str(path), tokenizer=str(folder), max_model_len=128,
              num_gpu_blocks_override=64).generate(prompts, sp, use_tqdm=False)
    from compare import assert_same_outputs

    assert_same_outputs([o.outputs[0] for o in ref], [o.outputs[0] for o in got], f"{arch} gguf")


def test_gguf_quantized_experts_close(paths, tmp_path):
    """Q8_0 [E, I, H] expert tensors are dequantized at load; the first token's logprob stays close."""
    gguf = pytest.importorskip("gguf")
    folder = paths["qwen3_moe"]
    path = write_moe_gguf(folder, tmp_path / "q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    prompts = prompts_for(384, seed=6)[:4]
    sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=1)
    ref = LLM(str(folder), max_model_len=128, num_gpu_blocks_override=64).generate(prompts, sp, use_tqdm=False)
    got = LLM(str(path), tokenizer=str(folder), max_model_len=128,
              num_gpu_blocks_override=64).generate(prompts, sp, use_tqdm=False)
    for a, b in zip(ref, got):
        tid = a.outputs[0].token_ids[0]
        assert abs(a.outputs[0].logprobs[0][tid].logprob - b.outputs[0].logprobs[0].get(
            tid, a.outputs[0].logprobs[0][tid]).logprob) < 0.1


# ---- int8 experts ---------------------------------------------------------------------------------
def test_int8_experts_top1_agreement(paths):
    from test_quantization import AGREE_FLOOR, AGREE_STEPS, _teacher_forced_top1

    path = str(paths["qwen2_moe"])
    fllm = LLM(path, max_model_len=128, num_gpu_blocks_override=64)
    qllm = LLM(path, max_model_len=128, num_gpu_blocks_override=64, quantization="int8")
    experts = qllm.engine.model.layers[0].mlp.experts
    assert experts.w13_qweight.dtype == torch.int8 and not hasattr(experts, "w13_weight")
    prompts = prompts_for(384, seed=3)
    sp = SamplingParams(temperature=0.0, max_tokens=AGREE_STEPS, ignore_eos=True)
    cont = [o.outputs[0].token_ids for o in fllm.generate(prompts, sp, use_tqdm=False)]
    seqs = [p + c for p, c in zip(prompts, cont)]
    got = _teacher_forced_top1(qllm, seqs, [len(p) for p in prompts])
    hits = sum(a == b for x, y in zip(got, cont) for a, b in zip(x, y))
    assert hits / (AGREE_STEPS * len(prompts)) >= AGREE_FLOOR["int8"], hits


# ---- tensor parallel over real collectives --------------------------------------------------------
class _Holder(torch.nn.Module):
    """One MoE block under the generic loader (checkpoint names `mlp.*`)."""

    packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        from tokenmill.model.blocks import Build
        from tokenmill.model.moe_block import MoEBlock, MoESpec

        spec = MoESpec(E, 2, I, renormalize=False, shared_intermediate_size=64)
        self.mlp = MoEBlock(H, spec, Build(torch.float32, torch.float32, None, tp_rank, tp_size), "mlp")


def _block_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    t = {"mlp.gate.weight": torch.randn(E, H, generator=g), "mlp.shared_expert_gate.weight": torch.randn(1, H, generator=g),
         "mlp.shared_expert.gate_proj.weight": torch.randn(64, H, generator=g) * 0.1,
         "mlp.shared_expert.up_proj.weight": torch.randn(64, H, generator=g) * 0.1,
         "mlp.shared_expert.down_proj.weight": torch.randn(H, 64, generator=g) * 0.1}
    for e, (w1, w3, w2) in enumerate(_experts()):
        t.update({f"mlp.experts.{e}.gate_proj.weight": w1, f"mlp.experts.{e}.up_proj.weight": w3,
                  f"mlp.experts.{e}.down_proj.weight": w2})
    return t


def _block_output(tp_rank: int, tp_size: int, x: torch.Tensor) -> torch.Tensor:
    from tokenmill.model.weights import load_weights

    m = _Holder(tp_rank, tp_size)
    load_weights(m, _block_weights().items())
    return m.mlp(x)


def _tp2_moe_block(rank: int, x: torch.Tensor) -> torch.Tensor:
    return _block_output(rank, 2, x)


def test_moe_block_tp2_equals_tp1():
    """Experts and shared expert sharded over two gloo ranks, loaded by the generic loader, one all-reduce."""
    from gloo_ranks import run_ranks

    x = torch.randn(7, H, generator=torch.Generator().manual_seed(8))
    full = _block_output(0, 1, x)
    results = run_ranks(_tp2_moe_block, x)
    for r in range(2):
        torch.testing.assert_close(results[r], full, rtol=0, atol=1e-5)
