"""bf16 weights prepacked for oneDNN (layers/quantization/onednn_pack.py): the product equals F.linear's, a
loaded model holds packed weights and no plain copies (the tied embedding excepted), and greedy output is
the output of the same model with packing off."""
import pytest
import torch
import torch.nn.functional as F

from tokenmill import LLM, SamplingParams
from tokenmill.layers.embedding import PackedFloatHead
from tokenmill.layers.quantization import onednn_pack

from tiny import make_tiny_model

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not onednn_pack._native_math(torch.bfloat16),
                       reason="oneDNN has no native bf16 math on this CPU: weights are never packed here"),
]


@pytest.fixture
def packing(monkeypatch):
    """Set TOKENMILL_ONEDNN_PACK for one test (the switch is read once per process otherwise)."""
    def set_(on: bool):
        monkeypatch.setenv("TOKENMILL_ONEDNN_PACK", "1" if on else "0")
        onednn_pack._enabled.cache_clear()
    yield set_
    monkeypatch.delenv("TOKENMILL_ONEDNN_PACK", raising=False)
    onednn_pack._enabled.cache_clear()


@pytest.mark.parametrize("n,k", [(64, 64), (96, 33), (17, 200), (1, 8)])
@pytest.mark.parametrize("rows", [0, 1, 3, 17, 65])
def test_packed_linear_equals_f_linear(packing, n, k, rows):
    packing(True)
    g = torch.Generator().manual_seed(n * 1000 + k + rows)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    assert onednn_pack.packable(w)
    p = onednn_pack.pack(w)
    assert p.is_mkldnn and p.shape == w.shape and p.dtype == w.dtype
    assert torch.equal(p.to_dense(), w)  # the layout changes, the values do not
    for bias in (None, b):
        got = onednn_pack.packed_linear(x, p, bias)
        ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        # bf16 output: one rounding of a float32 accumulation (2^-8 relative) plus the bias add.
        torch.testing.assert_close(got.double(), ref, rtol=2 ** -7, atol=2 ** -7 * (1 + ref.abs().amax().item() if rows else 1))


def test_packed_linear_other_shapes_and_dtypes(packing):
    packing(True)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 40, generator=g).bfloat16()
    p = onednn_pack.pack(w)
    x3 = torch.randn(2, 5, 40, generator=g).bfloat16()
    torch.testing.assert_close(onednn_pack.packed_linear(x3, p), F.linear(x3, w), rtol=2 ** -7, atol=2 ** -6)
    xt = torch.randn(40, 6, generator=g).bfloat16().t()  # rows not contiguous
    torch.testing.assert_close(onednn_pack.packed_linear(xt, p), F.linear(xt, w), rtol=2 ** -7, atol=2 ** -6)
    x32 = torch.randn(3, 40, generator=g)  # not the packed dtype: unpacked, upcast, exact float32 product
    torch.testing.assert_close(onednn_pack.packed_linear(x32, p), F.linear(x32, w.float()))


def test_what_is_not_packed(packing):
    packing(True)
    assert not onednn_pack.packable(torch.randn(8, 8))  # float32: dense_linear's
    assert not onednn_pack.packable(torch.empty(0, 8, dtype=torch.bfloat16))
    packing(False)
    assert not onednn_pack.packable(torch.randn(8, 8).bfloat16())


def _greedy(path, **kw):
    llm = LLM(str(path), dtype="bfloat16", max_model_len=256, num_gpu_blocks_override=64, **kw)
    prompts = [[5 + i, 17, 33 + 2 * i, 101, 7] * (i + 1) for i in range(4)]
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return llm, out


@pytest.mark.parametrize("tied", [True, False])
def test_bf16_model_packed_and_greedy_equal_to_unpacked(tmp_path, packing, tied):
    path = make_tiny_model(tmp_path / "m", "llama", tie_word_embeddings=tied)
    packing(True)
    llm, packed = _greedy(path)
    model = llm.engine.model
    linears = [m for m in model.modules() if hasattr(m, "quant_method") and hasattr(m, "weight")]
    assert linears and all(m.weight.is_mkldnn for m in linears)
    head = model.lm_head
    assert isinstance(head.table_method, PackedFloatHead) and head.packed_weight.is_mkldnn
    if tied:  # the embedding's lookups keep the plain table
        assert not model.embed_tokens.weight.is_mkldnn
        assert head.weight is model.embed_tokens.weight
    else:
        assert "weight" not in head._parameters
    llm.close()

    packing(False)
    llm, plain = _greedy(path)
    assert not any(p.is_mkldnn for p in llm.engine.model.parameters())
    llm.close()
    for a, b in zip(packed, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(la[t].logprob - lb[t].logprob) < 0.05
