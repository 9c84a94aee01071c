"""Medusa heads (Cai et al. 2024): several heads over the target's last hidden state, head i guessing the token
i + 2 places ahead, all in one small batched computation after the target's step (no draft forward, no KV).

Published layout (the Medusa repository's, e.g. FasterDecoding/medusa-vicuna-7b-v1.3): a folder with
`config.json` holding `medusa_num_heads` and `medusa_num_layers`, and `medusa_lm_head.safetensors` (or
`medusa_lm_head.pt`, a state dict) with, for head i, residual blocks j < medusa_num_layers
`medusa_head.{i}.{j}.linear.weight [H, H]` / `.bias [H]` (x <- x + SiLU(W x + b)) and the vocabulary projection
`medusa_head.{i}.{medusa_num_layers}.weight [V, H]` (no bias); the `medusa_head.` prefix may be absent. The input
is the target's final hidden state (after its last norm) at the position that produced the last emitted token.

Proposals: the chain of each head's top token (head i's for position p + 2 + i), as many heads as k allows; a
point-mass draft, so verification stays exact for sampled requests too (docs/speculative.md).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.spec_decode.draft import Draft, StepView

WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


class MedusaHeads(nn.Module):
    """num_heads heads of num_layers residual blocks and a vocabulary projection, run as batched matmuls."""

    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.num_layers = num_heads, num_layers
        self.res_weight = nn.Parameter(torch.zeros(num_heads, num_layers, hidden, hidden, dtype=dtype),
                                       requires_grad=False)
        self.res_bias = nn.Parameter(torch.zeros(num_heads, num_layers, hidden, dtype=dtype), requires_grad=False)
        self.proj = nn.Parameter(torch.zeros(num_heads, vocab, hidden, dtype=dtype), requires_grad=False)

    def forward(self, hidden: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """hidden [B, H] -> logits [heads, B, V] of the first `heads` heads."""
        n = self.num_heads if heads is None else heads
        x = hidden.to(self.proj.dtype).unsqueeze(0).expand(n, -1, -1)
        for j in range(self.num_layers):
            w, b = self.res_weight[:n, j], self.res_bias[:n, j]
            x = x + F.silu(torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2)))
        return torch.bmm(x, self.proj[:n].transpose(1, 2)).float()


def load_medusa(path: str, hidden: int, vocab: int, dtype: torch.dtype) -> MedusaHeads:
    """The heads of a Medusa folder, checked against the target's hidden size and vocabulary."""
    folder = Path(path)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"medusa: {folder} has no config.json (with medusa_num_heads, medusa_num_layers).")
    cfg = json.loads(cfg_file.read_text())
    try:
        num_heads, num_layers = int(cfg["medusa_num_heads"]), int(cfg["medusa_num_layers"])
    except KeyError as e:
        raise ValueError(f"medusa: {cfg_file} lacks {e.args[0]}.") from None
    weights = next((folder / w for w in WEIGHTS if (folder / w).is_file()), None)
    if weights is None:
        raise ValueError(f"medusa: {folder} has neither {' nor '.join(WEIGHTS)}.")
    if weights.suffix == ".pt":
        state = torch.load(weights, map_location="cpu", weights_only=True)
    else:
        from safetensors.torch import load_file

        state = load_file(str(weights))
    state = {k.removeprefix("medusa_head."): v for k, v in state.items()}
    heads = MedusaHeads(hidden, vocab, num_heads, num_layers, dtype)
    used = set()

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in state:
            raise ValueError(f"medusa: {weights.name} lacks medusa_head.{name}.")
        t = state[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"medusa: medusa_head.{name} is {tuple(t.shape)}, expected {shape} (the target's "
                             f"hidden size {hidden}, vocabulary {vocab}).")
        used.add(name)
        return t

    for i in range(num_heads):
        for j in range(num_layers):
            heads.res_weight.data[i, j] = take(f"{i}.{j}.linear.weight", (hidden, hidden))
            heads.res_bias.data[i, j] = take(f"{i}.{j}.linear.bias", (hidden,))
        heads.proj.data[i] = take(f"{i}.{num_layers}.weight", (vocab, hidden))
    unused = sorted(set(state) - used)
    if unused:
        raise ValueError(f"medusa: unexpected tensors in {weights.name}: {', '.join(unused[:5])}.")
    return heads


class MedusaDrafter:
    """A lookup-kind drafter (its cost is one call per step): each drafting request's row of the target's hidden
    states through the heads, the top token of each of the first k heads as the chain."""

    def __init__(self, heads: MedusaHeads) -> None:
        self.heads = heads

    def forget(self, rid: str) -> None:
        pass

    @staticmethod
    def source_row(view: StepView, i: int) -> int:
        """The packed row whose hidden state produced request i's last emitted token: its position is the
        sequence's length - 2, and the step's rows start at position view.starts[i]."""
        return int(view.row_starts[i]) + view.length(i) - 2 - int(view.starts[i])

    @torch.inference_mode()
    def propose(self, view: StepView, want: set[int], k: int) -> dict[int, Draft]:
        if not want or view.hidden is None:
            return {}
        order = sorted(want)
        rows = torch.tensor([self.source_row(view, i) for i in order], device=view.hidden.device)
        n = min(k, self.heads.num_heads)
        tokens = self.heads(view.hidden.index_select(0, rows), n).argmax(-1).T.tolist()  # [B, n]
        return {i: Draft(t, None) for i, t in zip(order, tokens)}
