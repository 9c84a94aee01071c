"""The sync-free Triton MoE path (issue 31, tokenmill/layers/moe_triton.py), run on this CPU under
TRITON_INTERPRET=1: align_by_expert's invariants, the grouped GEMMs against a float64 per-expert loop (float32,
bfloat16, top-1/top-2, uneven routing, empty experts, an expert-parallel subset), FusedMoE.forward with
TOKENMILL_MOE_TRITON=1 against its default CPU path, and no host read during the call. (Small shapes: the
interpreter runs each program in numpy.)"""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from test_moe import _experts, _inputs, _layer, _reference

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _ids(T: int, k: int, num_experts: int, seed: int) -> torch.Tensor:
    """Uneven routing: k distinct experts per token, drawn with skewed odds (the last experts stay idle)."""
    g = torch.Generator().manual_seed(seed)
    odds = torch.tensor([2.0**-i for i in range(num_experts)])
    odds[-2:] = 0  # two experts with no tokens
    return torch.multinomial(odds.expand(T, -1), k, generator=g)


# ---- align_by_expert ------------------------------------------------------------------------------
@pytest.mark.parametrize("T,k,num_experts,block_m", [(1, 1, 4, 16), (3, 2, 6, 16), (17, 2, 6, 16), (40, 2, 5, 32),
                                                    (9, 1, 8, 16)])
def test_align_by_expert_invariants(T, k, num_experts, block_m):
    from tokenmill.layers.moe_triton import align_by_expert, padded_length

    ids = _ids(T, k, num_experts, seed=T)
    b = align_by_expert(ids, num_experts, block_m)
    P = T * k
    assert b.sorted_pair_ids.numel() == padded_length(P, num_experts, block_m)
    assert b.sorted_pair_ids.numel() <= -(-(P + num_experts * (block_m - 1)) // block_m) * block_m
    blocks = b.sorted_pair_ids.view(-1, block_m)
    assert b.expert_of_block.numel() == blocks.shape[0]
    used = int(b.num_used_blocks)
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts)
    assert used == sum(-(-c // block_m) for c in counts.tolist())
    real = b.sorted_pair_ids[b.sorted_pair_ids < P]
    assert sorted(real.tolist()) == list(range(P))  # every pair exactly once
    assert (b.sorted_pair_ids[b.sorted_pair_ids >= P] == P).all()  # padding: the sentinel
    assert (blocks[used:] == P).all() and (b.expert_of_block[used:] == num_experts).all()
    flat = ids.reshape(-1)
    for i, e in enumerate(b.expert_of_block[:used].tolist()):
        pairs = blocks[i][blocks[i] < P]
        assert pairs.numel() > 0 and (flat[pairs] == e).all()  # each used block: one expert, never empty
        assert torch.equal(pairs, pairs.sort().values)  # token order kept within an expert
    assert b.expert_of_block[:used].tolist() == sorted(b.expert_of_block[:used].tolist())


def test_align_by_expert_leaves_out_other_ranks_experts():
    from tokenmill.layers.moe_triton import align_by_expert

    ids = torch.tensor([[0, 5], [-2, 1], [7, 4], [1, 0]])  # local experts 0..3; the rest live elsewhere
    b = align_by_expert(ids, 4, 16)
    real = b.sorted_pair_ids[b.sorted_pair_ids < 8]
    assert sorted(real.tolist()) == [0, 3, 6, 7]
    assert int(b.num_used_blocks) == 2 and b.expert_of_block[:2].tolist() == [0, 1]
    none_here = align_by_expert(torch.full((2, 2), 9), 4, 16)
    assert int(none_here.num_used_blocks) == 0 and (none_here.sorted_pair_ids == 4).all()


# ---- the kernels against float64 ---------------------------------------------------------------------
H, I = 64, 32


def _weights(num_experts: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * I, H, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(num_experts, H, I, generator=g) * 0.1).to(dtype)
    return w13, w2


def _ref64(x, w13, w2, weights, ids, first=0):
    """Per-expert loop in float64 over the same (rounded) inputs; pairs of other ranks' experts add nothing."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        t, j = torch.nonzero(ids == e + first, as_tuple=True)
        if t.numel():
            gate, up = F.linear(x[t], w13[e]).chunk(2, -1)
            y = F.linear(F.silu(gate) * up, w2[e]) * weights[t, j].double().unsqueeze(1)
            out.index_add_(0, t, y)
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)],
                         ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("T", [1, 3, 17])
def test_fused_moe_triton_matches_float64(dtype, tol, k, T):
    from tokenmill.layers.moe_triton import fused_moe_triton

    num_experts = 6
    w13, w2 = _weights(num_experts, dtype)
    g = torch.Generator().manual_seed(T * 10 + k)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = _ids(T, k, num_experts, seed=T + k)
    weights = torch.rand(T, k, generator=g)
    got = fused_moe_triton(x, w13, w2, weights, ids)
    assert got.shape == (T, H) and got.dtype == dtype
    ref = _ref64(x, w13, w2, weights, ids)
    assert (got.double() - ref).abs().max() <= tol * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("T,block_m", [(40, 32), (70, 64)])
def test_prefill_sized_blocks(T, block_m):
    """Many rows per expert take larger blocks (and runs longer than one block)."""
    from tokenmill.layers.moe_triton import choose_block_m, fused_moe_triton

    assert choose_block_m(T * 2, 2) == block_m
    w13, w2 = _weights(2, torch.float32)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.zeros(T, dtype=torch.long), torch.ones(T, dtype=torch.long)], 1)
    ids[::3] = ids[::3].flip(1)
    weights = torch.rand(T, 2, generator=g)
    torch.testing.assert_close(fused_moe_triton(x, w13, w2, weights, ids).double(), _ref64(x, w13, w2, weights, ids),
                               rtol=0, atol=1e-5)


def test_empty_batch():
    from tokenmill.layers.moe_triton import fused_moe_triton

    w13, w2 = _weights(4, torch.float32)
    out = fused_moe_triton(torch.zeros(0, H), w13, w2, torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long))
    assert out.shape == (0, H)


@pytest.mark.parametrize("T", [1, 17])
def test_expert_parallel_subset(T):
    """Rank 1 of 2 holds experts 3..5: its output is the float64 sum over exactly those pairs."""
    from tokenmill.layers.moe_triton import fused_moe_triton

    w13, w2 = _weights(6, torch.float32)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g)
    ids = torch.randint(0, 6, (T, 2), generator=g)
    weights = torch.rand(T, 2, generator=g)
    parts = [fused_moe_triton(x, w13[r * 3:(r + 1) * 3], w2[r * 3:(r + 1) * 3], weights, ids, r * 3, 3)
             for r in range(2)]
    torch.testing.assert_close(parts[1].double(), _ref64(x, w13[3:], w2[3:], weights, ids, first=3),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close((parts[0] + parts[1]).double(), _ref64(x, w13, w2, weights, ids), rtol=0, atol=1e-5)


def test_grouped_gemm_with_mixed_weight_dtype():
    """bfloat16 weights under float32 activations are computed in float32 (as F.linear after an upcast)."""
    from tokenmill.layers.moe_triton import align_by_expert, grouped_gemm

    w13, _ = _weights(4, torch.bfloat16)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(2))
    ids = _ids(5, 2, 4, seed=2)
    b = align_by_expert(ids, 4, 16)
    got = grouped_gemm(x, w13, x.new_full((10, 2 * I), float("nan")), b, 2)
    ref = torch.stack([F.linear(x[p // 2], w13[int(ids.reshape(-1)[p])].float()) for p in range(10)])
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


# ---- the layer --------------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [1, 9])
def test_fused_moe_layer_triton_path_equals_the_cpu_path(monkeypatch, T):
    from tokenmill.layers import moe

    experts = _experts()
    layer = _layer(experts)
    x, w, ids = _inputs(9)
    x, w, ids = x[:T], w[:T], ids[:T]
    default = layer(x, w, ids)
    assert not moe._triton(layer, x)  # off on the CPU unless asked for
    monkeypatch.setenv("TOKENMILL_MOE_TRITON", "1")
    assert moe._triton(layer, x)
    calls = []
    real = moe.UnquantizedMoEMethod.linear
    monkeypatch.setattr(moe.UnquantizedMoEMethod, "linear", lambda *a: calls.append(1) or real(*a))
    got = layer(x, w, ids)
    assert not calls  # the Triton path, not the per-expert GEMMs
    torch.testing.assert_close(got, default, rtol=0, atol=1e-5)
    torch.testing.assert_close(got, _reference(x, w, ids, experts), rtol=0, atol=1e-5)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # compiled Triton has no CPU target
    assert not moe._triton(layer, x)


def test_quantized_experts_never_take_the_triton_path(monkeypatch):
    from tokenmill.layers import moe

    monkeypatch.setenv("TOKENMILL_MOE_TRITON", "1")
    layer = _layer(_experts(), method=moe.Int8MoEMethod())
    with pytest.raises(AttributeError):  # (no w13_weight once quantized: the check must not get that far)
        layer.w13_weight
    assert not moe._triton(layer, torch.zeros(2, H))


# ---- no host sync ---------------------------------------------------------------------------------
def test_no_host_sync(monkeypatch):
    """Every way torch reads a tensor's values back to the host raises during the call (on CUDA each would be a
    sync, and none can be captured in a CUDA graph). Triton's interpreter is no obstacle: it copies the arguments'
    storages with .cpu() and computes on numpy arrays, never through these methods."""
    from tokenmill.layers.moe_triton import fused_moe_triton

    w13, w2 = _weights(6, torch.float32)
    x = torch.randn(17, H, generator=torch.Generator().manual_seed(3))
    ids = _ids(17, 2, 6, seed=3)
    weights = torch.rand(17, 2, generator=torch.Generator().manual_seed(4))
    ref = fused_moe_triton(x, w13, w2, weights, ids, 2, 3)

    def sync(*_a, **_k):
        raise AssertionError("a host read of a tensor's values")

    for name in ("tolist", "item", "__bool__", "__int__", "__index__", "__float__", "nonzero", "numpy",
                 "bincount", "unique", "repeat_interleave", "masked_select"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    for name in ("nonzero", "bincount", "unique", "repeat_interleave", "masked_select"):
        monkeypatch.setattr(torch, name, sync)
    got = fused_moe_triton(x, w13, w2, weights, ids, 2, 3)  # (align_by_expert included)
    monkeypatch.undo()
    assert torch.equal(got, ref)
