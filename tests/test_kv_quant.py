"""Quantized KV cache (--kv-cache-dtype int8 / fp8): the quantize helpers, the native kernel against the
torch_sdpa reference on the same quantized cache, pool sizing, and whole-model greedy parity."""
from __future__ import annotations

import pytest
import torch

from tokenmill import native
from tokenmill.layers.attention import Attention
from tokenmill.layers.attention_backends import get_attention_backend, kv_quant
from tests.test_cpu_paged_attention import make_case, reference

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
