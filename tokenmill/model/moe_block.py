"""The sparse feed-forward block of the MoE families: router -> top-k experts (layers/moe.py FusedMoE),
plus Qwen2-MoE's shared expert (a dense gated MLP on every token, scaled by sigmoid(shared_expert_gate)).

Parameter names follow transformers' `mlp.gate`, `mlp.experts.*`, `mlp.shared_expert.*` and
`mlp.shared_expert_gate` (Mixtral's `block_sparse_moe.` is renamed to `mlp.` by its WeightNaming). The
router and the shared-expert gate stay unquantized (routing decides which experts run). Under tensor
parallelism experts and shared expert produce partial sums; the block all-reduces once. With expert
parallelism each rank runs only its own whole experts for the tokens routed to them (every rank sees every
token: attention stays tensor-parallel), and the same single all-reduce combines them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.layers import collectives
from tokenmill.layers.activation import act_fn, gated
from tokenmill.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from tokenmill.layers.moe import FusedMoE, route

if TYPE_CHECKING:
    from tokenmill.model.blocks import Build


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    renormalize: bool  # top-k weights rescaled to sum to 1 (norm_topk_prob; always for Mixtral)
    activation: str = "silu"
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert; 0: none


class MoEBlock(nn.Module):
    def __init__(self, hidden_size: int, moe: MoESpec, build: "Build", prefix: str) -> None:
        super().__init__()
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.tp_size = build.tp_size
        self.gate = ReplicatedLinear(hidden_size, moe.num_experts, params_dtype=build.params_dtype,
                                     compute_dtype=build.compute_dtype, prefix=f"{prefix}.gate")
        # Expert parallel: rank r holds whole experts [r E/N, (r+1) E/N); else a slice of every expert.
        ep = build.expert_parallel and build.tp_size > 1
        self.experts = FusedMoE(moe.num_experts, hidden_size, moe.intermediate_size, moe.activation,
                                reduce_results=False, tp_rank=0 if ep else build.tp_rank,
                                tp_size=1 if ep else build.tp_size, params_dtype=build.params_dtype,
                                quant_config=build.quant_config, prefix=f"{prefix}.experts",
                                ep_rank=build.tp_rank if ep else 0, ep_size=build.tp_size if ep else 1)
        self.has_shared = moe.shared_intermediate_size > 0
        if self.has_shared:
            n = moe.shared_intermediate_size
            self.shared_expert = SharedExpert(hidden_size, n, moe.activation, build, f"{prefix}.shared_expert")
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, params_dtype=build.params_dtype,
                                                       compute_dtype=build.compute_dtype,
                                                       prefix=f"{prefix}.shared_expert_gate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.has_shared:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.tp_size > 1:
            collectives.all_reduce(out)
        return out


class SharedExpert(nn.Module):
    """A gated MLP whose down projection leaves its partial sum unreduced (the block reduces once)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, build: "Build",
                 prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, False,
                                                       **build.linear(f"{prefix}.gate_up_proj"))
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, reduce_results=False,
                                           **build.linear(f"{prefix}.down_proj"))
        self.act_name, self.act = activation, act_fn(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated(self.gate_up_proj(x), self.act, self.act_name))
