"""Medusa heads (Cai et al. 2024): several heads over the target's last hidden state, head i guessing the token
i + 2 places ahead, all in one small batched computation after the target's step (no draft forward, no KV).

Published layout (the Medusa repository's, e.g. FasterDecoding/medusa-vicuna-7b-v1.3): a folder with
`config.json` holding `medusa_num_heads` and `medusa_num_layers`, and `medusa_lm_head.safetensors` (or
`medusa_lm_head.pt`, a state dict) with, for head i, residual blocks j < medusa_num_layers
`medusa_head.{i}.{j}.linear.weight [H, H]` / `.bias [H]` (x <- x + SiLU(W x + b)) and the vocabulary projection
`medusa_head.{i}.{medusa_num_layers}.weight [V, H]` (no bias); the `medusa_head.` prefix may be absent. The input
is the target's final hidden state (after its last norm) at the position that produced the last emitted token.
A tokenmill extension: heads without `medusa_head.{i}.{L}.weight` use the target's own LM head (one batched call
over all heads' rows, in its quantized format: for a small model with a large vocabulary, 49k x 576 for SmolLM2,
a float projection per head would cost several times the model's own step). `tokenmill train-medusa` writes such
heads (their projection frozen at the LM head while training).

Proposals: a static tree (`medusa_choices`, the Medusa repository's format: each node as the path of top-k ranks
leading to it; a default tree of 16 nodes otherwise), its first k nodes per step, verified in one target forward
with a tree attention mask (sample/tree_sampler.py); or, where a tree cannot be verified exactly or the choices are
a chain, each head's top token as a chain. Point-mass drafts, so verification stays exact for sampled requests.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.spec_decode.draft import Draft, StepView
from tokenmill.spec_decode.head_folder import fill, find_weights, load_state, read_config
from tokenmill.spec_decode.tree import choices_to_tree, depths, is_chain, tree_safe

WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


class MedusaHeads(nn.Module):
    """num_heads heads of num_layers residual blocks and a vocabulary projection, run as batched matmuls."""

    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int, dtype: torch.dtype,
                 own_projection: bool = True) -> None:
        super().__init__()
        self.num_heads, self.num_layers = num_heads, num_layers
        self.res_weight = nn.Parameter(torch.zeros(num_heads, num_layers, hidden, hidden, dtype=dtype),
                                       requires_grad=False)
        self.res_bias = nn.Parameter(torch.zeros(num_heads, num_layers, hidden, dtype=dtype), requires_grad=False)
        self.proj = (nn.Parameter(torch.zeros(num_heads, vocab, hidden, dtype=dtype), requires_grad=False)
                     if own_projection else None)  # None: the target's LM head (`lm_head` in forward)
        self.lm_head = None  # set by the proposer when proj is None: hidden [N, H] -> float32 logits [N, V]

    def features(self, hidden: torch.Tensor, heads: int) -> torch.Tensor:
        """hidden [B, H] -> each head's input to its projection [heads, B, H]."""
        x = hidden.to(self.res_weight.dtype).unsqueeze(0).expand(heads, -1, -1)
        for j in range(self.num_layers):
            w, b = self.res_weight[:heads, j], self.res_bias[:heads, j]
            x = x + F.silu(torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2)))
        return x

    def forward(self, hidden: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """hidden [B, H] -> logits [heads, B, V] of the first `heads` heads."""
        n = self.num_heads if heads is None else heads
        x = self.features(hidden, n)
        if self.proj is None:
            return self.lm_head(x.reshape(-1, x.shape[-1])).view(n, x.shape[1], -1).float()
        return torch.bmm(x, self.proj[:n].transpose(1, 2)).float()


def load_medusa(path: str, hidden: int, vocab: int, dtype: torch.dtype) -> MedusaHeads:
    """The heads of a Medusa folder, checked against the target's hidden size and vocabulary."""
    folder = Path(path)
    cfg = read_config(folder, "medusa", "with medusa_num_heads, medusa_num_layers")
    try:
        num_heads, num_layers = int(cfg["medusa_num_heads"]), int(cfg["medusa_num_layers"])
    except KeyError as e:
        raise ValueError(f"medusa: {folder / 'config.json'} lacks {e.args[0]}.") from None
    weights = find_weights(folder, WEIGHTS, "medusa")
    state = {k.removeprefix("medusa_head."): v for k, v in load_state(weights).items()}
    own = [f"{i}.{num_layers}.weight" in state for i in range(num_heads)]
    if any(own) and not all(own):
        missing = next(i for i, o in enumerate(own) if not o)
        raise ValueError(f"medusa: {weights.name} lacks medusa_head.{missing}.{num_layers}.weight (either every head "
                         "has its projection or none: then the target's LM head is used).")
    heads = MedusaHeads(hidden, vocab, num_heads, num_layers, dtype, own_projection=all(own))
    params = {}
    for i in range(num_heads):
        for j in range(num_layers):
            params[f"{i}.{j}.linear.weight"] = heads.res_weight.data[i, j]
            params[f"{i}.{j}.linear.bias"] = heads.res_bias.data[i, j]
        if heads.proj is not None:
            params[f"{i}.{num_layers}.weight"] = heads.proj.data[i]
    fill("medusa", weights.name, state, params, f" (the target's hidden size {hidden}, vocabulary {vocab})",
         shown=lambda name: f"medusa_head.{name}")
    return heads


# A default tree of 16 nodes (each the path of top-k ranks through the heads, parents first): the top few
# candidates of the first heads, the top one deeper, in the spirit of the Medusa repository's trees.
DEFAULT_CHOICES = [[0], [1], [0, 0], [2], [0, 1], [1, 0], [0, 0, 0], [3], [0, 2], [0, 0, 1], [1, 1], [0, 1, 0],
                   [0, 0, 0, 0], [2, 0], [1, 0, 0], [0, 0, 0, 1]]


class MedusaDrafter:
    """A lookup-kind drafter (its cost is one call per step): each drafting request's row of the target's hidden
    states through the heads; the tree's nodes take their head's candidate of their rank (head d for a node at
    depth d + 1). Requests whose sampling depends on the tokens before each row (penalties, a grammar, min_tokens
    still pending) and models with sliding windows (their masks count slots, not a node's path) get the chain
    of each head's top token instead."""

    def __init__(self, heads: MedusaHeads, choices: list[list[int]] | None, trees: bool) -> None:
        self.heads = heads
        choices = [c for c in (choices or DEFAULT_CHOICES) if len(c) <= heads.num_heads]
        self.parents = choices_to_tree(choices)
        self.depth = depths(self.parents) - 1  # the head of each node
        self.rank = np.array([c[-1] for c in choices], dtype=np.int64)
        self.trees = trees and not is_chain(self.parents)
        self.shape = "tree" if self.trees else "chain"  # what its k means to the adaptive policy

    def forget(self, rid: str) -> None:
        pass

    @torch.inference_mode()
    def propose(self, view: StepView, want: set[int], k: int) -> dict[int, Draft]:
        if not want or view.hidden is None:
            return {}
        order = sorted(want)
        rows = torch.tensor([view.source_row(i) for i in order], device=view.hidden.device)
        n = min(k, len(self.parents))  # nodes of the tree
        chain = min(k, self.heads.num_heads)
        depth, rank = self.depth[:n], self.rank[:n]
        used = max(int(depth.max()) + 1, chain)
        logits = self.heads(view.hidden.index_select(0, rows), used)  # [used heads, B, V]
        top = logits.topk(max(int(rank.max()) + 1, 1), dim=-1).indices.cpu().numpy()  # [heads, B, K]
        tree_tokens = top[depth, :, rank].T  # [B, n]
        chains = top[:chain, :, 0].T  # [B, chain]
        parents = self.parents[:n]
        tree = self.trees and not is_chain(parents)
        out = {}
        for b, i in enumerate(order):
            if tree and tree_safe(view.requests[i], view.length(i)):
                out[i] = Draft(tree_tokens[b].tolist(), None, parents)
            else:
                out[i] = Draft(chains[b].tolist(), None)
        return out
