"""DeepSeekMoE (DeepSeek-V2/V3): routed experts chosen by a group-limited router, plus shared experts that every
token runs, added unscaled.

The router scores every expert in float32: softmax (V2) or sigmoid (V3). Group-limited top-k first keeps the
`topk_group` best of `n_group` expert groups (a group's score: its best expert under V2's
group_limited_greedy, the sum of its two best under V3's noaux_tc, with the `e_score_correction_bias` added
for the choice only), then picks the top-k experts among those; a token's weights are the chosen experts'
unbiased scores, renormalised to sum to 1 with `norm_topk_prob`, times `routed_scaling_factor`. V2's
`greedy` takes the top-k of all experts.

The experts are the shared FusedMoE (layers/moe.py) and the shared experts moe_block.SharedExpert; the block
is MoEBlock's with this router instead of Qwen's softmax and sigmoid-gated shared expert.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.layers import collectives
from tokenmill.model.moe_block import MoEBlock, MoESpec, SharedExpert

if TYPE_CHECKING:
    from tokenmill.model.blocks import Build

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class RouterSpec:
    scoring: str  # "softmax" (V2) | "sigmoid" (V3)
    topk_method: str  # one of TOPK_METHODS
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    correction_bias: bool  # V3: the checkpoint's gate.e_score_correction_bias shifts the choice


def grouped_topk(logits: torch.Tensor, top_k: int, renormalize: bool, r: RouterSpec,
                 bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights float32 [T, k], expert ids int64 [T, k]), as transformers' DeepSeek routers."""
    logits = logits.float()
    scores = logits.softmax(-1) if r.scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias.float()
    T, E = choice.shape
    if r.topk_method != "greedy":
        grouped = choice.view(T, r.n_group, E // r.n_group)
        group_scores = grouped.max(-1).values if r.topk_method == "group_limited_greedy" \
            else grouped.topk(2, dim=-1)[0].sum(-1)
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, group_scores.topk(r.topk_group, dim=-1, sorted=False)[1], True)
        kept = kept.unsqueeze(-1).expand(T, r.n_group, E // r.n_group).reshape(T, E)
        # V2 zeroes the other groups' scores and weighs by what it picked; V3 rules them out and weighs by the
        # unbiased scores. (The same whenever the kept groups hold at least k experts.)
        choice = choice.masked_fill(~kept, 0.0 if r.topk_method == "group_limited_greedy" else float("-inf"))
        if r.topk_method == "group_limited_greedy":
            scores = choice
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * r.routed_scaling_factor, ids


class Router(nn.Module):
    """`mlp.gate`: weight [E, H] (applied in float32) and, for V3, e_score_correction_bias [E]."""

    def __init__(self, num_experts: int, hidden_size: int, correction_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(num_experts), requires_grad=False)
                                        if correction_bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.float(), self.weight)


class DeepseekMoEBlock(MoEBlock):
    def __init__(self, hidden_size: int, moe: MoESpec, router: RouterSpec, build: "Build", prefix: str) -> None:
        if router.topk_method not in TOPK_METHODS:
            raise ValueError(f"DeepSeek topk_method {router.topk_method!r} is not supported; "
                             f"tokenmill supports {', '.join(TOPK_METHODS)}")
        if router.topk_method != "greedy" and moe.num_experts % router.n_group:
            raise ValueError(f"{moe.num_experts} experts do not divide into n_group={router.n_group} groups")
        # MoEBlock builds the experts (tensor or expert parallel); no Qwen shared expert, its own router below.
        super().__init__(hidden_size, MoESpec(moe.num_experts, moe.top_k, moe.intermediate_size, moe.renormalize,
                                              moe.activation), build, prefix)
        self.router = router
        self.gate = Router(moe.num_experts, hidden_size, router.correction_bias)
        self.shared_experts = (SharedExpert(hidden_size, moe.shared_intermediate_size, moe.activation, build,
                                            f"{prefix}.shared_experts") if moe.shared_intermediate_size else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = grouped_topk(self.gate(x), self.top_k, self.renormalize, self.router,
                                    self.gate.e_score_correction_bias)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if self.tp_size > 1:
            collectives.all_reduce(out)
        return out
