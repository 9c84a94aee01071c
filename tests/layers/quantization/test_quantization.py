"""Weight-only quantization (--quantization int8|int4).

- The native kernels (torch.ops.tokenmill.int8_linear / int4_linear) equal x @ dequantize(W)^T (+ b)
  over a grid of shapes that covers every code path of csrc/quant_linear.cpp: decode (M <= 2, vectors
  along K), small batches (M 3..7: transposed tile, a 6-row block and every remainder), M >= 8 (whole
  weight dequantized + SGEMM), partial tiles (N not a multiple of 16 or 4), several tiles (N = 100),
  vector tails (int8 K = 37), two threads.
- quantize/dequantize round trips: error <= scale / 2, zeros exact (int8, symmetric int4), an asymmetric
  group's min and max exact (so a 16-level grid such as a dequantized Q4_1 block survives unchanged),
  constant and all-zero rows.
- Whole models (tiny llama, qwen3, qwen2; a hidden-128 llama for int4 g128): greedy tokens with the
  kernels equal the pure-torch fallback (dequantize + F.linear), and equal a float model whose
  checkpoint holds the dequantized weights (the quantization is applied per row/group of the right
  tensors, fused qkv/gate_up included); top-1 agreement with the float model above a stated floor.
- Resident bytes: exact, from the linear layers' shapes (embeddings / LM head stay float).
- Errors: unknown method, a group that does not divide a layer's input, an unsupported group size.
"""
from __future__ import annotations

import argparse
import math
import shutil

import pytest
import torch

from compare import assert_same_outputs
from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams, native
from tokenmill.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
from tokenmill.layers.quantization import weight_only as wo
from tokenmill.model import native_stack
from tokenmill.layers.quantization.weight_only import (Int4LinearMethod, Int8LinearMethod, WeightOnlyConfig,
                                                       dequantize_int4, dequantize_int8, quantize_int4,
                                                       quantize_int8)

# ---------------------------------------------------------------------------------------------------
# Kernels vs the dequantized reference
# ---------------------------------------------------------------------------------------------------

NS = (1, 5, 16, 33, 100)
KS = (32, 64, 96, 128, 384, 576)  # 128 and 384 so that group 128 has shapes too
MS = (1, 2, 3, 4, 5, 6, 7, 13, 64)
GROUPS = (32, 64, 128)


def _have_ops() -> bool:
    return native.available() and hasattr(torch.ops.tokenmill, "int8_linear") and \
        hasattr(torch.ops.tokenmill, "int4_linear")


needs_native = pytest.mark.skipif(not _have_ops(), reason="tokenmill._C not built or without int8/int4_linear")


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    if bias is not None:
        y = y + bias.double()
    return y.float()


def _check(y: torch.Tensor, ref: torch.Tensor, K: int, label: str) -> None:
    assert y.dtype == torch.float32 and y.shape == ref.shape, f"{label}: {y.dtype} {tuple(y.shape)}"
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * math.sqrt(K), msg=lambda m: f"{label}: {m}")


def _bias(N: int, with_bias: bool, g: torch.Generator) -> torch.Tensor | None:
    return torch.randn(N, generator=g) if with_bias else None


@needs_native
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_int8_kernel_matches_dequantized_reference(with_bias):
    g = torch.Generator().manual_seed(11)
    for K in KS + (1, 37):  # 1 and 37: the scalar tail after the last full vector along K (decode path)
        for N in NS:
            w = torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g) * 3  # rows of different scale
            q, s = quantize_int8(w)
            W = dequantize_int8(q, s)
            b = _bias(N, with_bias, g)
            for M in MS:
                x = torch.randn(M, K, generator=g)
                y = torch.ops.tokenmill.int8_linear(x, q, s, b)
                _check(y, _reference(x, W, b), K, f"int8 M={M} N={N} K={K} bias={with_bias}")


@needs_native
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_int4_kernel_matches_dequantized_reference(group, symmetric, with_bias):
    g = torch.Generator().manual_seed(group + symmetric)
    shapes = 0
    for K in (k for k in KS if k % group == 0):
        for N in NS:
            w = torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g) * 3
            packed, s, z = quantize_int4(w, group, symmetric)
            assert packed.dtype == torch.uint8 and packed.shape == (N, K // 2)
            assert s.shape == z.shape == (N, K // group)
            W = dequantize_int4(packed, s, z, group)
            b = _bias(N, with_bias, g)
            for M in MS:
                x = torch.randn(M, K, generator=g)
                y = torch.ops.tokenmill.int4_linear(x, packed, s, z, group, b)
                _check(y, _reference(x, W, b), K, f"int4 g{group} sym={symmetric} M={M} N={N} K={K} bias={with_bias}")
                shapes += 1
    assert shapes >= 2 * len(NS) * len(MS)  # group 128 too has at least two K


@needs_native
def test_int4_kernel_any_nibbles_scales_and_zeros():
    """Packed bytes, scales and (non-integer) zeros not produced by quantize_int4: every nibble value in
    both halves of a byte, so a swapped nibble order or a wrong group index cannot hide."""
    g = torch.Generator().manual_seed(5)
    for group, K, N in ((32, 96, 33), (64, 128, 16), (128, 384, 5)):
        packed = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
        s = torch.rand(N, K // group, generator=g) + 0.01
        z = torch.rand(N, K // group, generator=g) * 15
        W = dequantize_int4(packed, s, z, group)
        for M in (1, 2, 3, 64):
            x = torch.randn(M, K, generator=g)
            _check(torch.ops.tokenmill.int4_linear(x, packed, s, z, group, None), _reference(x, W, None), K,
                   f"int4 random g{group} M={M} N={N} K={K}")
        # one-hot rows of x read single weights: column k of W, i.e. nibble (k % 2) of byte k // 2
        eye = torch.eye(K)
        for M in (1, 2, K):
            cols = torch.cat([torch.ops.tokenmill.int4_linear(eye[i:i + M], packed, s, z, group, None)
                              for i in range(0, K, M)])
            torch.testing.assert_close(cols.T, W, rtol=1e-6, atol=1e-6)


@needs_native
def test_kernels_same_bits_with_two_threads_and_odd_inputs():
    """Tiles are independent: below 8 rows (the kernel's own GEMM) the result is bit-identical with 1
    or 2 threads; from 8 rows on (ATen's SGEMM) it is close. x may be non-contiguous or bf16 (converted
    to float); the output is float32 [M, N]; M = 0 gives an empty result."""
    g = torch.Generator().manual_seed(7)
    N, K = 100, 576
    w = torch.randn(N, K, generator=g)
    q8, s8 = quantize_int8(w)
    p4, s4, z4 = quantize_int4(w, 64, False)
    b = torch.randn(N, generator=g)
    run8 = lambda x: torch.ops.tokenmill.int8_linear(x, q8, s8, b)  # noqa: E731
    run4 = lambda x: torch.ops.tokenmill.int4_linear(x, p4, s4, z4, 64, b)  # noqa: E731
    threads = torch.get_num_threads()
    try:
        for M in (1, 2, 7, 64):
            x = torch.randn(M, K, generator=g)
            torch.set_num_threads(1)
            one = run8(x), run4(x)
            torch.set_num_threads(2)
            two = run8(x), run4(x)
            if M < 8:
                assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1]), f"M={M}: threads change bits"
            else:
                _check(two[0], one[0], K, f"int8 M={M} 2 threads")
                _check(two[1], one[1], K, f"int4 M={M} 2 threads")
    finally:
        torch.set_num_threads(threads)
    xt = torch.randn(K, 5, generator=g).T  # non-contiguous [5, K]
    _check(run8(xt), _reference(xt, dequantize_int8(q8, s8), b), K, "int8 non-contiguous x")
    _check(run4(xt), _reference(xt, dequantize_int4(p4, s4, z4, 64), b), K, "int4 non-contiguous x")
    xb = torch.randn(3, K, generator=g).bfloat16()
    _check(run8(xb), _reference(xb.float(), dequantize_int8(q8, s8), b), K, "int8 bf16 x")
    _check(run4(xb), _reference(xb.float(), dequantize_int4(p4, s4, z4, 64), b), K, "int4 bf16 x")
    assert run8(torch.empty(0, K)).shape == (0, N) and run4(torch.empty(0, K)).shape == (0, N)


@needs_native
def test_kernels_run_under_inference_mode_on_two_threads():
    """The engine calls the kernels under torch.inference_mode: the batched path's worker threads write
    panels of the (inference-mode) output too, so they must not trip autograd's inference-tensor checks."""
    g = torch.Generator().manual_seed(11)
    N, K = 1536, 576  # many panels: every thread gets some
    w = torch.randn(N, K, generator=g)
    q8, s8 = quantize_int8(w)
    p4, s4, z4 = quantize_int4(w, 32, False)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for M in (1, 5, 64):
            x = torch.randn(M, K, generator=g)
            with torch.inference_mode():
                y8 = torch.ops.tokenmill.int8_linear(x, q8, s8, None)
                y4 = torch.ops.tokenmill.int4_linear(x, p4, s4, z4, 32, None)
            _check(y8, _reference(x, dequantize_int8(q8, s8), None), K, f"int8 M={M} inference mode")
            _check(y4, _reference(x, dequantize_int4(p4, s4, z4, 32), None), K, f"int4 M={M} inference mode")
    finally:
        torch.set_num_threads(threads)


@needs_native
def test_kernels_reject_bad_arguments():
    q, s = quantize_int8(torch.randn(8, 64))
    p, s4, z4 = quantize_int4(torch.randn(8, 64), 32, False)
    x = torch.randn(2, 64)
    bad = [
        lambda: torch.ops.tokenmill.int8_linear(torch.randn(2, 63), q, s, None),  # K mismatch
        lambda: torch.ops.tokenmill.int8_linear(x, q.float(), s, None),  # not int8
        lambda: torch.ops.tokenmill.int8_linear(x, q, s[:7], None),  # scale size
        lambda: torch.ops.tokenmill.int4_linear(x, p, s4, z4, 48, None),  # group does not divide K
        lambda: torch.ops.tokenmill.int4_linear(x, p, s4, z4, 3, None),  # odd group
        lambda: torch.ops.tokenmill.int4_linear(x, p, s4[:, :1], z4, 32, None),  # scale shape
        lambda: torch.ops.tokenmill.int4_linear(x, p.to(torch.int8), s4, z4, 32, None),  # not uint8
    ]
    for i, call in enumerate(bad):
        try:
            call()
        except RuntimeError:
            continue
        pytest.fail(f"bad call {i} was accepted")


# Regression: the kernel once dequantized as q * scale - zero * scale, which FMA contraction (-O3
# -march=native) turned into a rounding error instead of 0 where q == zero; (q - zero) * scale is exact.
@needs_native
def test_int4_kernel_keeps_zero_weights_exactly_zero():
    g = torch.Generator().manual_seed(3)
    N, K = 33, 64
    w = torch.randn(N, K, generator=g)
    w[:, ::3] = 0.0
    packed, s, z = quantize_int4(w, 32, symmetric=True)  # zero point 8: weights of 0 are exactly 0
    assert (dequantize_int4(packed, s, z, 32)[:, ::3] == 0).all()  # the reference keeps them
    eye = torch.eye(K)
    batch = torch.ops.tokenmill.int4_linear(eye, packed, s, z, 32, None).T  # the kernel's W (M >= 8 path)
    decode = torch.cat([torch.ops.tokenmill.int4_linear(eye[k:k + 1], packed, s, z, 32, None) for k in range(K)]).T
    cols = torch.cat([batch, decode])
    nonzero = int((cols[:, ::3] != 0).sum())
    assert nonzero == 0, f"{nonzero} of {2 * N * len(range(0, K, 3))} zero weights are not zero in the kernel " \
        f"(max {cols[:, ::3].abs().max().item():.3g})"


# ---------------------------------------------------------------------------------------------------
# quantize / dequantize round trips
# ---------------------------------------------------------------------------------------------------

SLACK = 1 + 1e-5  # float rounding of w / scale and of q * scale


def _special_rows(K: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    rows = [
        torch.randn(K, generator=g),
        torch.randn(K, generator=g) * 1e3,
        torch.randn(K, generator=g) * 1e-4,
        torch.full((K,), 0.37), torch.full((K,), -2.5), torch.full((K,), 1e-30),  # constant rows
        torch.zeros(K),  # all zero
        torch.rand(K, generator=g) + 1.0,  # all positive: zero point 0
        -torch.rand(K, generator=g) - 1.0,  # all negative: zero point 15
        torch.arange(K).float() % 31 * 0.5 - 7.5,  # halves in [-7.5, 7.5]: round-half-even ties at both ends
    ]
    r = torch.randn(K, generator=g)
    r[::4] = 0.0  # exact zeros among other values
    r[1] = 50.0  # an outlier
    rows.append(r)
    return torch.stack(rows)


def test_int8_round_trip():
    w = _special_rows(96)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and s.shape == (w.shape[0],)
    assert int(q.min()) >= -127 and int(q.max()) <= 127
    back = dequantize_int8(q, s)
    assert torch.isfinite(back).all() and torch.isfinite(s).all() and (s > 0).all()
    err = (back - w).abs()
    assert (err <= s[:, None] / 2 * SLACK).all(), f"max error / scale {(err / s[:, None]).max().item()}"
    assert (back[w == 0] == 0).all()  # zeros exact
    torch.testing.assert_close(back[3:6], w[3:6], rtol=1e-6, atol=0)  # constant rows: +-127 * scale
    assert (back[6] == 0).all()  # all-zero row: no NaN, zero
    # per-row scale: a row's error does not depend on the other rows' magnitude
    assert (err[2] <= w[2].abs().max() / 254 * SLACK).all()


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("group", GROUPS)
def test_int4_round_trip(group, symmetric):
    K = 384
    w = _special_rows(K)
    N = w.shape[0]
    packed, s, z = quantize_int4(w, group, symmetric)
    assert packed.dtype == torch.uint8 and packed.shape == (N, K // 2)
    assert s.dtype == z.dtype == torch.float32 and s.shape == z.shape == (N, K // group)
    assert torch.isfinite(s).all() and (s > 0).all() and torch.isfinite(z).all()
    if symmetric:
        assert (z == 8).all()
    # nibble layout: low nibble = even column, and every value in [0, 15]
    q = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(N, K)
    lo, hi = (packed & 0xF).int(), (packed >> 4).int()
    assert torch.equal(q[:, 0::2].int(), lo) and torch.equal(q[:, 1::2].int(), hi)
    back = dequantize_int4(packed, s, z, group)
    assert back.shape == w.shape and torch.isfinite(back).all()
    err = (back - w).abs().reshape(N, K // group, group)
    bound = (s / 2 * SLACK)[..., None]
    assert (err <= bound).all(), f"max error / scale {(err / s[..., None]).max().item()}"
    assert (back[6] == 0).all()  # all-zero row
    for r in (3, 4):  # constant rows (one sign each)
        torch.testing.assert_close(back[r], w[r], rtol=1e-6, atol=0)
    if symmetric:
        assert (back[w == 0] == 0).all(), "exact zeros must stay exactly zero"
    else:  # asymmetric: each group's min and max are levels 0 and 15, reproduced to float rounding
        gw, gb = w.reshape(N, K // group, group), back.reshape(N, K // group, group)
        torch.testing.assert_close(gb.amin(-1), gw.amin(-1), rtol=1e-5, atol=1e-6 * gw.abs().amax().item())
        torch.testing.assert_close(gb.amax(-1), gw.amax(-1), rtol=1e-5, atol=1e-6 * gw.abs().amax().item())
        assert int(q[0].min()) == 0 and int(q[0].max()) == 15


# ---------------------------------------------------------------------------------------------------
# A layer with a quant method
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["int8", "int4-g32-asym", "int4-g64-sym"])
def test_linear_layer_packs_weights_and_both_paths_agree(monkeypatch, method):
    from tokenmill.layers.linear import ReplicatedLinear

    K, N = 128, 40
    if method == "int8":
        qm = Int8LinearMethod()
    else:
        _, grp, sym = method.split("-")
        qm = Int4LinearMethod(int(grp[1:]), sym == "sym")
    layer = ReplicatedLinear(K, N, bias=True, quant_method=qm, prefix="layers.0.mlp.down_proj")
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(b)
    qm.process_weights_after_loading(layer)
    names = {n for n, _ in layer.named_parameters()}
    assert "weight" not in names and not hasattr(layer, "weight"), "the float weight must not stay resident"
    if method == "int8":
        assert names == {"qweight", "scale", "bias"} and layer.qweight.dtype == torch.int8
        W = dequantize_int8(*quantize_int8(w))
    else:
        assert names == {"qweight", "scale", "zero", "bias"} and layer.qweight.dtype == torch.uint8
        W = dequantize_int4(*quantize_int4(w, qm.group_size, qm.symmetric), qm.group_size)
    x = torch.randn(2, 3, K, generator=g)  # [batch, tokens, K]: apply flattens and restores the shape
    ref = (x.double() @ W.double().T + b.double()).float()
    monkeypatch.setattr(wo, "_NATIVE", False)
    fallback = layer(x)
    torch.testing.assert_close(fallback, ref, rtol=1e-4, atol=1e-4 * math.sqrt(K))
    if _have_ops():
        monkeypatch.setattr(wo, "_NATIVE", None)
        y = layer(x)
        assert wo._NATIVE is True, "the native kernels are built but not used"
        assert y.shape == (2, 3, N)
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * math.sqrt(K))


# ---------------------------------------------------------------------------------------------------
# Whole models
# ---------------------------------------------------------------------------------------------------

ENGINE_KW = dict(max_model_len=128, num_gpu_blocks_override=64, block_size=16, enable_prefix_caching=False)
NEW_TOKENS = 32
PROMPT_LENS = (3, 9, 17, 30, 45, 60)
AGREE_PROMPT_LENS = (3, 5, 9, 12, 17, 30, 45, 60)
AGREE_STEPS = 8
# Teacher-forced top-1 agreement with the float model over AGREE_STEPS positions of 8 prompts, measured
# on these tiny random models (logits of random weights are flat: small top-1 margins):
#   int8: llama 61/64, qwen3 63/64;  int4 g32: llama 48/64, qwen3 55/64 (other prompt sets: int4 llama 41/64).
AGREE_FLOOR = {"int8": 0.85, "int4": 0.55}
_LINEAR_RE = r"layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight"


class _Models:
    """Tiny checkpoints and engines, built once per module."""

    def __init__(self, root):
        self.root = root
        self.paths: dict = {}
        self.llms: dict = {}

    def path(self, arch: str):
        if arch not in self.paths:
            if arch == "llama128":  # every linear input a multiple of 128: int4 g128 applies
                self.paths[arch] = make_tiny_model(self.root / arch, "llama", hidden_size=128, intermediate_size=256)
            else:
                self.paths[arch] = make_tiny_model(self.root / arch, arch)
            if arch == "qwen2":  # q/k/v biases: random, not transformers' zero init, so the bias path counts
                from safetensors.torch import load_file, save_file

                f = str(self.paths[arch] / "model.safetensors")
                tensors = load_file(f)
                g = torch.Generator().manual_seed(9)
                biases = [n for n in tensors if n.endswith("_proj.bias")]
                assert len(biases) == 3 * 2, sorted(tensors)
                for n in biases:
                    tensors[n] = torch.randn(tensors[n].shape, generator=g) * 0.5
                save_file(tensors, f, metadata={"format": "pt"})
        return self.paths[arch]

    def llm(self, arch: str, quant: str | None = None, group: int = 32) -> LLM:
        key = (arch, quant, group)
        if key not in self.llms:
            self.llms[key] = LLM(str(self.path(arch)), quantization=quant, quantization_group_size=group, **ENGINE_KW)
        return self.llms[key]

    def fake_quant_path(self, arch: str, quant: str, group: int):
        """The checkpoint with every decoder linear weight replaced by dequantize(quantize(w))."""
        import re

        from safetensors.torch import load_file, save_file

        key = ("fake", arch, quant, group)
        if key not in self.paths:
            dst = self.root / f"{arch}-fake-{quant}-g{group}"
            shutil.copytree(self.path(arch), dst)
            tensors = load_file(str(dst / "model.safetensors"))
            n = 0
            for name, t in tensors.items():
                if re.search(_LINEAR_RE, name):
                    if quant == "int8":
                        tensors[name] = dequantize_int8(*quantize_int8(t)).to(t.dtype)
                    else:
                        tensors[name] = dequantize_int4(*quantize_int4(t, group, False), group).to(t.dtype)
                    n += 1
            assert n >= 7 * 2, f"only {n} linear weights found in {sorted(tensors)}"
            # The LM head is kept as int8 rows too (a tied embedding shares that table).
            head = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
            tensors[head] = dequantize_int8(*quantize_int8(tensors[head])).to(tensors[head].dtype)
            save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
            self.paths[key] = dst
        return self.paths[key]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _Models(tmp_path_factory.mktemp("quant"))


def _prompts(vocab: int, lens=PROMPT_LENS, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def _greedy(llm: LLM, prompts, logprobs: int | None = None):
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=logprobs)
    return [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]


def _count_native(monkeypatch) -> dict:
    """Counts calls into each method's native kernel and its dequantize (the fallback's weight)."""
    calls = {"native": 0, "dequantize": 0}
    for cls in (Int8LinearMethod, Int4LinearMethod):
        def native_(self, layer, x, bias, _orig=cls._native):
            calls["native"] += 1
            return _orig(self, layer, x, bias)

        def dequantize_(self, layer, _orig=cls.dequantize):
            calls["dequantize"] += 1
            return _orig(self, layer)

        monkeypatch.setattr(cls, "_native", native_)
        monkeypatch.setattr(cls, "dequantize", dequantize_)
    return calls


MODEL_CASES = [("llama", "int8", 32), ("llama", "int4", 32), ("qwen3", "int8", 32), ("qwen3", "int4", 32),
               ("qwen2", "int8", 32), ("qwen2", "int4", 32), ("llama128", "int4", 128)]


@needs_native
@pytest.mark.parametrize("arch,quant,group", MODEL_CASES, ids=[f"{a}-{q}-g{g}" for a, q, g in MODEL_CASES])
def test_model_native_kernels_equal_fallback(models, monkeypatch, arch, quant, group):
    """Greedy tokens over 32 steps (and their logprobs) with the kernels == with dequantize + F.linear."""
    llm = models.llm(arch, quant, group)
    prompts = _prompts(llm.engine.vocab_size)
    monkeypatch.setenv(native_stack.ENV, "0")  # the Python layers, whose kernel calls are counted here
    calls = _count_native(monkeypatch)
    monkeypatch.setattr(wo, "_NATIVE", None)
    native_run = _greedy(llm, prompts, logprobs=3)
    assert calls["native"] > 0 and calls["dequantize"] == 0, calls
    monkeypatch.setattr(wo, "_NATIVE", False)
    calls.update(native=0, dequantize=0)
    fallback_run = _greedy(llm, prompts, logprobs=3)
    assert calls["native"] == 0 and calls["dequantize"] > 0, calls
    assert all(len(o.token_ids) == NEW_TOKENS for o in native_run + fallback_run)
    assert_same_outputs(native_run, fallback_run, f"{arch} {quant} g{group}: native vs fallback")


@pytest.mark.parametrize("arch,quant", [("llama", "int8"), ("llama", "int4"), ("qwen3", "int4"), ("qwen2", "int8")])
def test_model_equals_float_model_on_dequantized_checkpoint(models, arch, quant):
    """The quantized engine == the float engine on a checkpoint holding dequantize(quantize(w)) for each
    separate q/k/v/o/gate/up/down tensor: fusing qkv and gate_up before quantizing changes nothing, every
    decoder linear is quantized, and nothing else is."""
    qllm = models.llm(arch, quant, 32)
    fllm = LLM(str(models.fake_quant_path(arch, quant, 32)), **ENGINE_KW)
    prompts = _prompts(qllm.engine.vocab_size, seed=4)
    assert_same_outputs(_greedy(qllm, prompts, logprobs=3), _greedy(fllm, prompts, logprobs=3),
                     f"{arch} {quant}: quantized vs float on dequantized weights", atol=2e-4)


def _teacher_forced_top1(llm: LLM, seqs: list[list[int]], starts: list[int]) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    out = []
    for o, start, seq in zip(llm.generate(seqs, sp, use_tqdm=False), starts, seqs):
        # prompt_logprobs[pos]: the distribution of token pos given tokens [0, pos)
        out.append([next(t for t, lp in o.prompt_logprobs[pos].items() if lp.rank == 1)
                    for pos in range(start, len(seq))])
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_top1_agreement_with_float_model(models, arch, capsys):
    """Teacher-forced: each quantized model predicts the float model's greedy continuation, position by
    position, from the same (float) prefix; the fraction of top-1 hits is reported and held above a floor."""
    fllm = models.llm(arch)
    prompts = _prompts(fllm.engine.vocab_size, AGREE_PROMPT_LENS, seed=3)
    sp = SamplingParams(temperature=0.0, max_tokens=AGREE_STEPS, ignore_eos=True)
    cont = [o.outputs[0].token_ids for o in fllm.generate(prompts, sp, use_tqdm=False)]
    seqs = [p + c for p, c in zip(prompts, cont)]
    starts = [len(p) for p in prompts]
    assert _teacher_forced_top1(fllm, seqs, starts) == cont  # the measure itself: float agrees with itself
    total = AGREE_STEPS * len(prompts)
    report = {}
    for quant in ("int8", "int4"):
        got = _teacher_forced_top1(models.llm(arch, quant, 32), seqs, starts)
        hits = sum(a == b for x, y in zip(got, cont) for a, b in zip(x, y))
        report[quant] = hits / total
        with capsys.disabled():
            print(f"\n{arch} {quant}{' g32' if quant == 'int4' else ''}: top-1 agreement with float "
                  f"{hits}/{total} = {hits / total:.2f}", end="")
    for quant, frac in report.items():
        assert frac >= AGREE_FLOOR[quant], f"{arch} {quant}: top-1 agreement {frac:.2f} < {AGREE_FLOOR[quant]}"
    assert report["int8"] >= report["int4"], report


# ---------------------------------------------------------------------------------------------------
# Resident bytes
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_weight_bytes_exact(models, arch):
    from tokenmill.layers.linear import LinearBase

    fllm = models.llm(arch)
    float_bytes = fllm.engine.facts.weight_bytes
    model = fllm.engine.model
    assert float_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    shapes = [tuple(m.weight.shape) for m in model.modules() if isinstance(m, LinearBase)]
    assert len(shapes) == 4 * fllm.engine.hf_config.num_hidden_layers  # qkv, o, gate_up, down
    assert all(m.weight.dtype == torch.float32 for m in model.modules() if isinstance(m, LinearBase))
    linear_float = sum(n * k * 4 for n, k in shapes)
    # The LM head (or the table a tied embedding shares with it) becomes int8 rows + a float32 scale each.
    V, H = model.lm_head.weight.shape
    head = V * H + 4 * V - V * H * 4
    expected = {
        "int8": float_bytes - linear_float + head + sum(n * k + 4 * n for n, k in shapes),  # int8 q + f32 scale/row
        "int4-g32": float_bytes - linear_float + head + sum(n * k // 2 + 2 * 4 * n * k // 32 for n, k in shapes),
        "int4-g64": float_bytes - linear_float + head + sum(n * k // 2 + 2 * 4 * n * k // 64 for n, k in shapes),
    }
    got = {
        "int8": models.llm(arch, "int8", 32).engine.facts.weight_bytes,
        "int4-g32": models.llm(arch, "int4", 32).engine.facts.weight_bytes,
        "int4-g64": models.llm(arch, "int4", 64).engine.facts.weight_bytes,
    }
    assert got == expected, f"float {float_bytes}, linear float {linear_float}"
    assert float_bytes > got["int8"] > got["int4-g32"] > got["int4-g64"]
    # the LM head is int8 (sharing its table with a tied embedding); no decoder linear keeps a float weight
    qmodel = models.llm(arch, "int4", 32).engine.model
    assert qmodel.lm_head.qweight.dtype == torch.int8 and not hasattr(qmodel.lm_head, "weight")
    if qmodel.tie_word_embeddings:
        assert qmodel.embed_tokens.qweight is qmodel.lm_head.qweight
    else:
        assert qmodel.embed_tokens.weight.dtype == torch.float32
    assert not any(hasattr(m, "weight") for m in qmodel.modules() if isinstance(m, LinearBase))


# ---------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------

def test_unknown_method_is_a_value_error(models):
    with pytest.raises(ValueError, match=r"int3.*int8.*int4"):
        LLM(str(models.path("llama")), quantization="int3", **ENGINE_KW)
    with pytest.raises(ValueError, match=r"int3.*int8.*int4"):
        get_quantization_config("int3")
    assert set(QUANTIZATION_METHODS) == {"int8", "int4", "gguf"}
    assert get_quantization_config(None) is None
    assert isinstance(get_quantization_config("int4", 64), WeightOnlyConfig)


def test_cli_quantization_flags():
    from tokenmill.engine_args import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    argv = ["m", "--quantization", "int4", "--quantization-group-size", "64"]
    args = EngineArgs.from_cli_args(parser.parse_args(argv))
    assert (args.quantization, args.quantization_group_size) == ("int4", 64)
    config = args.create_engine_config()
    assert (config.model.quantization, config.model.quantization_group_size) == ("int4", 64)
    with pytest.raises(SystemExit):  # argparse: invalid choice
        parser.parse_args(["m", "--quantization", "int3"])


def test_group_that_does_not_divide_a_layer_input(models):
    # tiny llama: hidden 64, so the first layer built (layers.0.self_attn.qkv_proj, input 64) fails
    with pytest.raises(ValueError, match=r"128.*64.*layers\.0\.self_attn\.qkv_proj"):
        LLM(str(models.path("llama")), quantization="int4", quantization_group_size=128, **ENGINE_KW)


@pytest.mark.parametrize("group", [48, 0, 256])
def test_unsupported_group_size(models, group):
    with pytest.raises(ValueError, match=rf"group size.*{group}"):
        LLM(str(models.path("llama")), quantization="int4", quantization_group_size=group, **ENGINE_KW)


def test_int4_reproduces_a_q4_1_grid():
    """Weights already on a 16-level grid per 32 columns (a GGUF Q4_1 checkpoint, dequantized) come back
    unchanged from asymmetric int4 g32: quantizing them again adds no error."""
    g = torch.Generator().manual_seed(9)
    N, K = 24, 128
    q = torch.randint(0, 16, (N, K // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0.0, 15.0  # each block uses its whole range, as a Q4_1 quantizer makes it
    d = torch.rand(N, K // 32, 1, generator=g) * 0.01 + 1e-3
    m = torch.randn(N, K // 32, 1, generator=g) * 0.05
    w = (q * d + m).reshape(N, K)
    back = dequantize_int4(*quantize_int4(w, 32, symmetric=False), 32)
    torch.testing.assert_close(back, w, rtol=0, atol=2e-7)
