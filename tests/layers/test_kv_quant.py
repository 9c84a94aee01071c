"""Quantized KV cache (--kv-cache-dtype int8 / fp8): the quantize helpers, the native kernel against the
torch_sdpa reference on the same quantized cache, pool sizing, and whole-model greedy parity."""
from __future__ import annotations

import pytest
import torch

from tokenmill import native
from tokenmill.layers.attention import Attention
from tokenmill.layers.attention_backends import get_attention_backend, kv_quant
from test_cpu_paged_attention import make_case, reference

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels not built: {native.load()}")
INT8, FP8 = torch.int8, kv_quant.FP8
# Both backends attend over identical quantized bytes: they differ by float rounding only.
KERNEL_VS_REFERENCE = 1e-4
# Against attention over the unquantized float K/V (randn entries, head size 64-128): int8 keeps
# |error| <= scale/2 = max|x|/254 per element, e4m3 a relative 2^-4.
VS_FLOAT = {INT8: 3e-2, FP8: 2.5e-1}


# ---- helpers -----------------------------------------------------------------------------------------
def test_int8_round_trip_error_is_at_most_half_a_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 96, generator=g) * torch.logspace(-4, 3, 64).view(64, 1, 1)
    x[3, 1] = 0.0  # an all-zero row: scale 0, values 0
    q, s = kv_quant.quantize_int8(x)
    assert q.dtype == INT8 and s.shape == (64, 4) and s.dtype == torch.float32
    assert s[3, 1] == 0 and (q[3, 1] == 0).all()
    err = (kv_quant.dequantize_int8(q, s) - x).abs()
    assert (err <= s.unsqueeze(-1) / 2 * (1 + 1e-5) + 1e-30).all()
    assert q.abs().max() == 127  # the largest element of each row uses the whole range
    assert (q.abs().amax(-1)[s > 0] == 127).all()


def test_fp8_round_trip_and_saturation():
    x = torch.linspace(-3, 3, 1001)
    for scale in (1.0, 0.01):
        deq = kv_quant.dequantize_fp8(kv_quant.quantize_fp8(x * scale, scale), scale)
        # e4m3: 3 mantissa bits, half a step is 2^-4 relative (values below 2^-6 are subnormal).
        assert ((deq - x * scale).abs() <= (x * scale).abs() * 2**-4 + scale * 2**-10).all()
    big = kv_quant.dequantize_fp8(kv_quant.quantize_fp8(torch.tensor([1e6, -1e6, float("inf")]), 1.0), 1.0)
    assert big.tolist() == [448.0, -448.0, 448.0]


# ---- kernel vs reference -------------------------------------------------------------------------
def quantized_case(seed, ctx, ql, H, Hk, D, dtype, k_scale=1.0, v_scale=1.0, window=None):
    """make_case's float layout with its cache quantized. Returns the step, layout, float ground truth and
    the quantized cache twice: with NaN in every slot no query may see (poison for the kernel, which
    must never read one) and with zeros there (torch_sdpa reads whole blocks and masks)."""
    q, k, v, kc, vc, layout, fk, fv = make_case(seed, ctx, ql, H, Hk, D)
    if window is not None:
        for t, c, n in zip(layout.block_table, ctx, ql):
            for pos in range(max(0, c - n - window + 1)):
                kc[int(t[pos // 16]), pos % 16] = float("nan")
                vc[int(t[pos // 16]), pos % 16] = float("nan")
    if dtype == INT8:
        (kq, ks), (vq, vs) = kv_quant.quantize_int8(kc), kv_quant.quantize_int8(vc)
        poisoned = dict(k_cache=kq, v_cache=vq, k_scale_cache=ks, v_scale_cache=vs)
        zeroed = dict(k_cache=kq.clone(), v_cache=vq.clone(), k_scale_cache=ks.nan_to_num(0.0),
                      v_scale_cache=vs.nan_to_num(0.0))
    else:
        kq, vq = kv_quant.quantize_fp8(kc, k_scale), kv_quant.quantize_fp8(vc, v_scale)
        poisoned = dict(k_cache=kq, v_cache=vq)
        zeroed = dict(k_cache=kq.float().nan_to_num(0.0).to(FP8), v_cache=vq.float().nan_to_num(0.0).to(FP8))
    return q, k, v, layout, fk, fv, poisoned, zeroed


def run(backend_name, caches, q, k, v, layout, H, Hk, D, window=None, cap=None, k_scale=1.0, v_scale=1.0):
    backend = get_attention_backend(backend_name, "cpu")(caches["k_cache"].shape[1], torch.device("cpu"))
    layer = Attention(H, Hk, D, D ** -0.5, sliding_window=window, logits_soft_cap=cap)
    for name, t in caches.items():
        setattr(layer, name, t)
    layer.k_scale, layer.v_scale, layer.backend = k_scale, v_scale, backend
    out = layer(q, k, v, backend.build_metadata(layout))
    return out, layer


def check(dtype, seed, ctx, ql, H, Hk, D, window=None, cap=None, k_scale=1.0, v_scale=1.0):
    q, k, v, layout, fk, fv, poisoned, zeroed = quantized_case(seed, ctx, ql, H, Hk, D, dtype, k_scale, v_scale,
                                                                window)
    kw = dict(window=window, cap=cap, k_scale=k_scale, v_scale=v_scale)
    out, kernel_layer = run("cpu_paged", poisoned, q, k, v, layout, H, Hk, D, **kw)
    ref, ref_layer = run("torch_sdpa", zeroed, q, k, v, layout, H, Hk, D, **kw)
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max().item() <= KERNEL_VS_REFERENCE
    # Both wrote the step's K/V as the same bytes (and scales).
    slots = layout.slot_mapping
    for name in ("k_cache", "v_cache", "k_scale_cache", "v_scale_cache"):
        a, b = getattr(kernel_layer, name), getattr(ref_layer, name)
        if a is not None:
            a, b = a.flatten(0, 1)[slots], b.flatten(0, 1)[slots]
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    exact = reference(q, fk, fv, ql, D ** -0.5, window, cap)
    err = (out.double() - exact).abs().max().item()
    assert err <= VS_FLOAT[dtype]
    return out, exact


@needs_native
@pytest.mark.parametrize("dtype", [INT8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("heads", [(4, 4, 64), (9, 3, 64), (8, 1, 128), (6, 2, 80)],
                         ids=lambda h: f"H{h[0]}-Hk{h[1]}-D{h[2]}")
def test_kernel_matches_reference_decode_and_prefill(dtype, heads):
    """Decodes over ragged contexts (one long enough to be split over partitions), prompt chunks after a
    cached prefix and a whole prompt, GQA ratios 1, 3 and 8."""
    H, Hk, D = heads
    ctx = [1, 17, 300, 1500, 40, 300, 700, 37]
    ql = [1, 1, 1, 1, 40, 150, 60, 37]
    check(dtype, H + D, ctx, ql, H, Hk, D)


@needs_native
@pytest.mark.parametrize("dtype", [INT8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("window", [7, 64])
def test_kernel_matches_reference_sliding_window(dtype, window):
    ctx, ql = [30, 65, 700, 200, 300], [1, 1, 1, 200, 90]
    check(dtype, window, ctx, ql, 8, 2, 64, window=window)


@needs_native
def test_fp8_layer_scales_and_soft_cap():
    """Checkpoint scales other than 1 (folded into the softmax scale and the output) and Gemma's soft cap."""
    ctx, ql = [400, 90], [1, 90]
    check(FP8, 3, ctx, ql, 4, 2, 64, k_scale=0.02, v_scale=0.01)
    check(INT8, 4, ctx, ql, 4, 2, 64, cap=5.0)


@needs_native
def test_kernel_rejects_bad_scales():
    H, Hk, D = 4, 2, 64
    q, k, v, layout, fk, fv, poisoned, zeroed = quantized_case(1, [20], [1], H, Hk, D, INT8)
    poisoned["k_scale_cache"] = poisoned["k_scale_cache"][:, :, :1].contiguous()
    with pytest.raises(RuntimeError, match=r"float32 scales \[num_blocks, block_size, Hk\]"):
        run("cpu_paged", poisoned, q, k, v, layout, H, Hk, D)


# ---- whole model ---------------------------------------------------------------------------------
# Teacher-forced over the float model's own greedy continuations (32 tokens after each of 8 prompts),
# the quantized cache must pick the same next token at every position where the float model's top-2
# logprob gap exceeds MARGIN, and overall in at least AGREEMENT of positions. Free-running greedy text
# is not compared token for token: these tiny random models have many near ties (gaps < 0.01 nats) that
# any rounding flips, after which the two continuations are different texts. Measured on llama, qwen2,
# qwen3 and mistral tiny models: int8 98.3-99.4 %, flips only at gaps < 0.01; fp8 92.6-96.0 %, < 0.08.
MARGIN = {"int8": 0.02, "fp8": 0.15}
AGREEMENT = {"int8": 0.97, "fp8": 0.90}


def top1_with_margin(llm, seqs):
    from tokenmill import SamplingParams

    outs = llm.generate(seqs, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    res = []
    for o in outs:
        for pos in o.prompt_logprobs[1:]:
            (t1, a), (_, b) = sorted(pos.items(), key=lambda kv: -kv[1].logprob)[:2]
            res.append((t1, a.logprob - b.logprob))
    return res


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_sdpa"])
@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_greedy_top1_agrees_with_float_cache(tiny_llama, backend, kv):
    from tokenmill import LLM, SamplingParams
    from test_parity import prompts_for

    if backend == "cpu_paged" and not native.available():
        pytest.skip("native kernels not built")
    kw = dict(max_model_len=128, num_gpu_blocks_override=64, attention_backend=backend)
    base = LLM(str(tiny_llama), **kw)
    prompts = prompts_for(base.engine.vocab_size)
    sp = SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32)
    seqs = [p + o.outputs[0].token_ids for p, o in zip(prompts, base.generate(prompts, sp, use_tqdm=False))]
    quant = LLM(str(tiny_llama), kv_cache_dtype=kv, **kw)
    assert quant.engine.runner.kv_dtype == kv_quant.QUANT_KV_DTYPES[kv]
    ref, got = top1_with_margin(base, seqs), top1_with_margin(quant, seqs)
    same = [a[0] == b[0] for a, b in zip(ref, got)]
    assert all(s for s, (_, gap) in zip(same, ref) if gap > MARGIN[kv])
    assert sum(same) / len(same) >= AGREEMENT[kv]


@pytest.mark.parametrize("config", ["chunked", "preempted"])
def test_int8_prefix_caching_and_preemption_equal_caching_off(tiny_llama, config):
    """Blocks reused from the prefix cache hold the same quantized bytes a recompute would write."""
    from tokenmill import LLM
    from test_prefix_caching import CONFIGS, assert_same, params_for, run, stems_and_prompts

    kw = dict(CONFIGS[config], kv_cache_dtype="int8")
    prompts = stems_and_prompts()
    params = params_for(prompts)
    ref = run(LLM(str(tiny_llama), enable_prefix_caching=False, **kw), prompts, params)
    on = LLM(str(tiny_llama), enable_prefix_caching=True, **kw)
    assert_same(run(on, prompts, params), ref, f"int8 {config} first pass")
    second = run(on, prompts, params)
    assert_same(second, ref, f"int8 {config} second pass")
    assert on.engine.kv.stats.hits > 0 and sum(o.num_cached_tokens for o in second.values()) > 0
    if config == "preempted":
        assert on.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_offload_moves_quantized_blocks_and_restores_them(tiny_llama, tmp_path, kv):
    """Host and disk tiers carry the quantized values and int8's scales (fewer bytes than float32) and
    give back the same outputs as no offloading."""
    import glob

    from tokenmill import LLM
    from test_prefix_caching import assert_same, params_for, sequential, stems_and_prompts

    prompts = stems_and_prompts(seed=1, stems=4, stem_len=40)
    params = params_for(prompts)
    kw = dict(max_model_len=96, num_gpu_blocks_override=14, block_size=8, kv_cache_dtype=kv)
    ref = sequential(LLM(str(tiny_llama), enable_prefix_caching=False, **kw), prompts, params)
    # 2 layers x (K, V) x 8 slots x 2 KV heads x (16 values + int8's float32 scale)
    bpb = 2 * 2 * 8 * 2 * (16 + 4 if kv == "int8" else 16)
    llm = LLM(str(tiny_llama), kv_offload_bytes=8 * bpb, kv_offload_dir=str(tmp_path / "kv"),
              kv_offload_min_blocks=1, **kw)
    transfer = llm.engine.transfer
    assert llm.engine.runner.bytes_per_block == transfer.bytes_per_block == bpb
    assert bpb * 3 < 2 * 2 * 8 * 2 * 16 * 4  # under a third of float32's bytes per block
    assert_same(sequential(llm, prompts, params), ref, f"{kv} offload first pass")
    transfer.flush()
    assert glob.glob(str(tmp_path / "kv" / "*" / "*.kvb"))
    assert_same(sequential(llm, prompts, params), ref, f"{kv} offload second pass")
    st = llm.engine.kv.offload.stats
    assert st.host_loads > 0 and st.disk_loads > 0 and st.load_failures == 0, st


def test_transfer_round_trip_is_bit_exact(tiny_llama, tmp_path):
    """A block saved to the host tier and loaded into another device block: values and scales equal."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.core.kv_offload import LoadOp, SaveOp

    llm = LLM(str(tiny_llama), max_model_len=96, num_gpu_blocks_override=14, block_size=8, kv_cache_dtype="int8",
              kv_offload_bytes=1 << 16, kv_offload_min_blocks=1)
    llm.generate([list(range(3, 40))], SamplingParams(max_tokens=1), use_tqdm=False)  # fills blocks 0..4
    caches, transfer = llm.engine.runner.kv_caches(), llm.engine.transfer
    assert [c.dtype for c in caches[:4]] == [torch.int8, torch.int8, torch.float32, torch.float32]
    before = [c[2].clone() for c in caches]
    assert any(c.dtype == torch.float32 and c.abs().sum() > 0 for c in before)  # real scales were written
    transfer.run([SaveOp(2, 0, b"")])
    for c in caches:
        c[9].zero_()
    transfer.run([LoadOp(9, b"", slot=0)])
    for c, b in zip(caches, before):
        assert torch.equal(c[9], b)


# ---- sizing, configuration, checkpoint scales ----------------------------------------------------------
def test_same_budget_holds_more_blocks(tiny_llama):
    from tokenmill import LLM

    blocks = {}
    for kv in ("float32", "int8", "fp8_e4m3"):
        llm = LLM(str(tiny_llama), max_model_len=64, kv_cache_memory_bytes=1 << 20, kv_cache_dtype=kv)
        blocks[kv] = llm.engine.kv.num_blocks
        runner = llm.engine.runner
        allocated = sum(c.numel() * c.element_size() for c in runner.kv_caches())
        assert allocated == blocks[kv] * runner.bytes_per_block <= 1 << 20  # the scales are counted
        assert runner.backend.bytes_per_block(runner.attn_layers, runner.kv_dtype) == runner.bytes_per_block
    assert blocks["int8"] >= 1.9 * blocks["float32"]  # head_dim 16: (16 * 4) / (16 + 4) = 3.2x
    assert blocks["fp8_e4m3"] >= 1.9 * blocks["float32"]


def test_kv_cache_dtype_names_and_errors():
    import argparse

    from tokenmill.engine_args import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    for name in ("auto", "int8", "fp8", "fp8_e4m3"):
        args = EngineArgs.from_cli_args(parser.parse_args(["m", "--kv-cache-dtype", name]))
        assert args.create_engine_config().cache.kv_cache_dtype == name
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*int8, fp8, fp8_e4m3; got 'int4'"):
        EngineArgs(kv_cache_dtype="int4").create_engine_config()


def _with_tensors(path, extra):
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    weights = load_file(str(f))
    weights.update(extra)
    save_file(weights, str(f), metadata={"format": "pt"})


def test_fp8_scales_come_from_the_checkpoint(tmp_path):
    from tokenmill import LLM
    from tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "m", "llama")
    _with_tensors(path, {"model.layers.0.self_attn.k_scale": torch.tensor(0.05),
                         "model.layers.0.self_attn.v_scale": torch.tensor(0.02),
                         "model.layers.1.self_attn.kv_scale": torch.tensor([0.5])})
    llm = LLM(str(path), max_model_len=64, num_gpu_blocks_override=16, kv_cache_dtype="fp8")
    attn = [layer.self_attn.attn for layer in llm.engine.model.layers]
    assert [(a.k_scale, a.v_scale) for a in attn] == [(pytest.approx(0.05), pytest.approx(0.02)), (0.5, 0.5)]
    out = llm.generate([list(range(3, 30))], use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) > 0
    # Without scales in the checkpoint: 1.0, as vLLM.
    plain = make_tiny_model(tmp_path / "p", "llama")
    llm = LLM(str(plain), max_model_len=64, num_gpu_blocks_override=16, kv_cache_dtype="fp8")
    assert all(layer.self_attn.attn.k_scale == 1.0 for layer in llm.engine.model.layers)


@pytest.mark.parametrize("value, words", [(torch.tensor([0.1, 0.2]), "one value"), (torch.tensor(-1.0), "positive")])
def test_bad_checkpoint_scale_is_named(tmp_path, value, words):
    from tokenmill import LLM
    from tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "m", "llama")
    _with_tensors(path, {"model.layers.1.self_attn.k_scale": value})
    with pytest.raises(ValueError, match=rf"layers\.1\.self_attn\.k_scale.*{words}"):
        LLM(str(path), max_model_len=64, num_gpu_blocks_override=16, kv_cache_dtype="fp8")


@needs_native
@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.5, 0.25)])
def test_every_fp8_code_reads_back_exactly(k_scale, v_scale):
    """One-token decodes (attention weight exactly 1) over V rows holding every finite e4m3 value,
    subnormals and both zeros included: the kernel writes each code and decodes it to the same float."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = codes[codes.isfinite()]  # 254 codes: all but the two NaNs
    D = 64
    v = torch.cat([values, values[: 4 * D - len(values)]]).view(4, 1, D) * v_scale  # 4 tokens x 1 KV head
    k = torch.randn(4, 1, D)
    q = torch.randn(4, 2, D)
    layout_kw = dict(query_start=torch.arange(4), query_len=torch.ones(4, dtype=torch.long),
                     kv_len=torch.ones(4, dtype=torch.long), block_table=torch.arange(4, dtype=torch.int32).view(4, 1),
                     slot_mapping=torch.arange(4) * 16, num_tokens=4, max_query_len=1, max_kv_len=1)
    from tokenmill.layers.attention_backends import BatchLayout

    caches = dict(k_cache=torch.zeros(4, 16, 1, D, dtype=FP8), v_cache=torch.zeros(4, 16, 1, D, dtype=FP8))
    out, layer = run("cpu_paged", caches, q, k, v, BatchLayout(**layout_kw), 2, 1, D, k_scale=k_scale,
                     v_scale=v_scale)
    assert torch.equal(out, v.expand(4, 2, D))
    assert torch.equal(layer.v_cache[:, 0].float() * v_scale, v)
