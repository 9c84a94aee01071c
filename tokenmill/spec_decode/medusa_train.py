"""`tokenmill train-medusa`: Medusa heads for a model, trained on its own continuations (self-distillation,
spec_decode/self_distill.py: the corpus, features and loop the trainers share).

Head i maps the hidden state at position p to the token at p + 2 + i through `--layers` residual blocks
(x + SiLU(W x + b), W and b zero at the start, so every head begins as the LM head: Medusa's initialisation) and
the target's own LM head, frozen (so the heads need no vocabulary projection of their own: the published layout
without `medusa_head.{i}.{L}.weight`, read by spec_decode/medusa.py). Cross-entropy on the positions of the
continuations over the tokens the corpus uses, Adam; a tenth of the sequences held out for the accuracy report
(over the full vocabulary, as serving sees it).

Written: `config.json` (medusa_num_heads, medusa_num_layers, base_model_name_or_path) and
`medusa_lm_head.safetensors`; the report gives each head's top-1 and top-3 accuracy on the held-out positions.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill.spec_decode.head_folder import write_folder
from tokenmill.spec_decode.self_distill import PROMPTS  # noqa: F401  (benchmarks/speculative.py reads it here)
from tokenmill.spec_decode.self_distill import add_loop_args, add_trainer_parser, distill, fit, targets_ahead

WEIGHTS = "medusa_lm_head.safetensors"


@dataclass
class TrainReport:
    out: Path
    sequences: int
    positions: int
    seconds: float
    top1: list[float]  # per head, held-out
    top3: list[float]


def train_medusa(model: str | None, out: str, heads: int = 4, layers: int = 1, steps: int = 1000, batch: int = 256,
                 lr: float = 3e-3, max_tokens: int = 128, temperature: float = 0.0, seed: int = 0,
                 prompts: list[str] | None = None, **engine_kw) -> TrainReport:
    d = distill("train-medusa", model, prompts, max_tokens, temperature, seed, **engine_kw)
    V, H = d.W.shape
    held = d.held
    x_train, _, y_train, m_train = targets_ahead(d.feats[held:], d.seqs[held:], heads)
    x_test, _, y_test, m_test = targets_ahead(d.feats[:held], d.seqs[:held], heads)
    res_w = torch.zeros(heads, layers, H, H, requires_grad=True)
    res_b = torch.zeros(heads, layers, H, requires_grad=True)

    def logits(x: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:  # [N, H] -> [heads, N, rows of proj]
        z = x.unsqueeze(0).expand(heads, -1, -1)
        for j in range(layers):
            z = z + F.silu(torch.baddbmm(res_b[:, j].unsqueeze(1), z, res_w[:, j].transpose(1, 2)))
        return z @ proj.T

    y_local = d.local(y_train)

    def loss(pick: torch.Tensor) -> dict[str, torch.Tensor]:
        lg = logits(x_train[pick], d.W_train)  # [heads, b, v]
        y, m = y_local[pick].T, m_train[pick].T  # [heads, b]
        ce = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), y.reshape(-1), reduction="none")
        return {"loss": (ce * m.reshape(-1)).sum() / m.sum().clamp(min=1)}

    n = x_train.shape[0]
    fit("train-medusa", torch.optim.Adam([res_w, res_b], lr=lr), steps, batch, n, loss)
    with torch.no_grad():
        top1, top3 = [], []
        lg = logits(x_test, d.W)
        for i in range(heads):
            mask = m_test[:, i]
            top = lg[i][mask].topk(3, dim=-1).indices
            y = y_test[mask, i].unsqueeze(1)
            top1.append(float((top[:, :1] == y).any(1).float().mean()) if mask.any() else math.nan)
            top3.append(float((top == y).any(1).float().mean()) if mask.any() else math.nan)
    tensors = {}
    for i in range(heads):
        for j in range(layers):
            tensors[f"medusa_head.{i}.{j}.linear.weight"] = res_w[i, j]
            tensors[f"medusa_head.{i}.{j}.linear.bias"] = res_b[i, j]
    out_dir = write_folder(out, WEIGHTS, tensors, {
        "medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": model or "embedded",
        "hidden_size": H, "vocab_size": V, "tokenmill_projection": "the target's LM head"})
    return TrainReport(out_dir, len(d.seqs), n + x_test.shape[0], d.seconds(), top1, top3)


def add_train_medusa_parser(subparsers) -> None:
    p = add_trainer_parser(subparsers, "train-medusa", "Train Medusa heads for a model on its own continuations.",
                           __doc__, WEIGHTS, cmd_train_medusa)
    p.add_argument("--heads", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--layers", type=int, default=1, help="residual blocks per head (default: %(default)s)")
    add_loop_args(p, steps=1000, batch=256, lr=3e-3)


def cmd_train_medusa(args: argparse.Namespace) -> int:
    r = train_medusa(args.model, args.out, args.heads, args.layers, args.steps, args.batch, args.lr, args.max_tokens,
                     args.temperature, args.seed)
    acc = ", ".join(f"head {i}: {a:.2f}/{b:.2f}" for i, (a, b) in enumerate(zip(r.top1, r.top3)))
    print(f"wrote {r.out}: {len(r.top1)} heads from {r.sequences} continuations ({r.positions} positions) in "
          f"{r.seconds:.0f} s; held-out top-1/top-3 accuracy {acc}")
    return 0
