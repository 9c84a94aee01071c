"""gpt-oss under expert parallelism (--enable-expert-parallel with TP=2): each rank holds half the experts whole
(their clamped-SwiGLU weights and biases, float or MXFP4), the router with its bias replicated; the ranks' partial
outputs add up to the whole layer's, which equals a float64 reference computed from the checkpoint's own tensors
(interleaved gate/up, the down bias once per routed pair). The engine-level TP=2+EP = TP=1 checks are in
test_gpt_oss.py (float) and test_mxfp4.py (MXFP4)."""
from __future__ import annotations

import pytest
import torch

from test_mxfp4 import quantize_mxfp4
from tokenmill.layers.quantization.mxfp4 import Mxfp4Config, dequantize_mxfp4
from tokenmill.model.blocks import Build
from tokenmill.model.gpt_oss import ExpertsSpec, GptOssExperts

E, H, I, K = 4, 64, 64, 2
SPEC = ExpertsSpec(num_experts=E, top_k=K, intermediate_size=I, alpha=1.702, limit=1.5)


def checkpoint(mxfp4: bool) -> dict[str, torch.Tensor]:
    """One layer's expert tensors in the checkpoint's layout (gate_up_proj [E, H, 2I] interleaved, down [E, I, H]);
    with mxfp4 also their *_blocks / *_scales, the float ones then the dequantized values."""
    torch.manual_seed(0)
    t = {"gate_up_proj": torch.randn(E, H, 2 * I) * 0.3, "gate_up_proj_bias": torch.randn(E, 2 * I) * 0.5,
         "down_proj": torch.randn(E, I, H) * 0.3, "down_proj_bias": torch.randn(E, H) * 0.5}
    if mxfp4:
        for name in ("gate_up_proj", "down_proj"):
            blocks, scales = quantize_mxfp4(t[name].transpose(1, 2))  # rows = output features
            t[name + "_blocks"], t[name + "_scales"] = blocks, scales
            t[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
    return t


def built(t: dict[str, torch.Tensor], mxfp4: bool, **build) -> GptOssExperts:
    layer = GptOssExperts(SPEC, H, Build(torch.float32, torch.float32, Mxfp4Config() if mxfp4 else None, **build))
    for name, p in layer.named_parameters():
        p.weight_loader(p, t[name])
    return layer


def reference(t: dict[str, torch.Tensor], x, weights, ids) -> torch.Tensor:
    """float64, pair by pair, straight from the checkpoint's tensors (transformers' GptOssExperts' arithmetic)."""
    d = {k: v.double() for k, v in t.items()}
    out = torch.zeros(x.shape, dtype=torch.float64)
    for tok in range(x.shape[0]):
        for j in range(K):
            e = int(ids[tok, j])
            gate_up = x[tok].double() @ d["gate_up_proj"][e] + d["gate_up_proj_bias"][e]
            gate = gate_up[0::2].clamp(max=SPEC.limit)
            up = gate_up[1::2].clamp(-SPEC.limit, SPEC.limit)
            h = (up + 1) * gate * torch.sigmoid(gate * SPEC.alpha)
            out[tok] += float(weights[tok, j]) * (h @ d["down_proj"][e] + d["down_proj_bias"][e])
    return out


@pytest.mark.parametrize("mxfp4", [False, True], ids=["float", "mxfp4"])
def test_expert_parallel_ranks_sum_to_the_whole_layer(mxfp4):
    t = checkpoint(mxfp4)
    whole = built(t, mxfp4)
    halves = [built(t, mxfp4, tp_rank=r, tp_size=2, expert_parallel=True) for r in range(2)]
    slices = [built(t, mxfp4, tp_rank=r, tp_size=2) for r in range(2)]  # tensor-parallel experts, for contrast
    for r, h in enumerate(halves):  # whole experts: half of them, full intermediate size
        assert (h.num_local, h.first, h.shard) == (2, 2 * r, I)
        w = h.gate_up_proj_blocks if mxfp4 else h.gate_up_proj
        assert w.shape[0] == 2 and w.shape[1] == 2 * I
        torch.testing.assert_close(h.down_proj_bias, t["down_proj_bias"][2 * r:2 * r + 2])
    for T in (1, 7):
        torch.manual_seed(T)
        x = torch.randn(T, H)
        top, ids = torch.topk(torch.randn(T, E), K, dim=-1)
        if T == 7:
            ids[:3] = torch.tensor([0, 1])  # some tokens entirely on rank 0's experts: rank 1 runs none of them
        weights = top.softmax(-1)
        ref = reference(t, x, weights, ids).float()
        torch.testing.assert_close(whole(x, weights, ids), ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(sum(h(x, weights, ids) for h in halves), ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(sum(s(x, weights, ids) for s in slices), ref, rtol=1e-4, atol=1e-4)
        # each rank's part is its own experts' pairs only (with their down biases)
        part0 = reference(t, x, weights * (ids < 2), ids).float()
        torch.testing.assert_close(halves[0](x, weights, ids), part0, rtol=1e-4, atol=1e-4)


def test_uneven_experts_refused():
    with pytest.raises(ValueError, match="4 experts do not divide over expert-parallel size 3"):
        GptOssExperts(SPEC, H, Build(torch.float32, torch.float32, None, tp_rank=0, tp_size=3, expert_parallel=True))
