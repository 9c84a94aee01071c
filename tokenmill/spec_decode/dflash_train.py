"""`tokenmill train-dflash`: a block drafter (spec_decode/dflash.py) for a model, trained on the model's own
continuations (self-distillation, spec_decode/self_distill.py: the corpus, features and loop the trainers
share).

At each position p of a continuation the drafter reads the target's final hidden state h_p and the embedding of
the token t it produced, and learns the K tokens that follow t (positions p + 2 .. p + K + 1) in one forward.
Cross-entropy through the target's frozen LM head over the tokens the corpus uses, Adam. Then
the acceptance head learns, for each position whose earlier drafts were right, whether its own draft is (binary
cross-entropy on the drafter's features, the drafter frozen), on a tenth of the sequences the drafter was not
trained on (on its own training positions the drafter is right far more often than on new text, and an estimate
learned there overstated acceptance 3x), so the product of its estimates predicts how much of a block
verification keeps. Another tenth is held out for the report: per-position top-1 (over the
full vocabulary), the mean accepted prefix of a block, and the mean estimate of it.

Initialisation: the input projection passes h through and the blocks add nothing (zero output projections), so
every position starts as the LM head over h; the positions differ by what they learn.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill.spec_decode.dflash import BlockDrafter, BlockDrafterConfig
from tokenmill.spec_decode.self_distill import Distillation, add_loop_args, add_trainer_parser, distill, embed, fit, \
    targets_ahead


@dataclass
class DFlashReport:
    out: Path
    sequences: int
    positions: int
    seconds: float
    top1: list[float]  # per block position, held-out
    accepted: float  # mean accepted prefix of a block (greedy drafts against the continuation), held-out
    estimated: float  # mean of the acceptance head's estimate of that prefix


def _examples(d: Distillation, part: slice, K: int):
    """(h [N, H], e [N, H], targets [N, K], mask [N, K]) over the continuations' positions of d.seqs[part]: e the
    embedding of the token h produced."""
    h, last, y, m = targets_ahead(d.feats[part], d.seqs[part], K)
    return h, embed(d.llm, last), y, m


def _prefix_ok(correct: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N, K]: the drafts before position j were all right (and present)."""
    ok = (correct & mask).float()
    before = torch.cumprod(torch.cat([torch.ones_like(ok[:, :1]), ok[:, :-1]], 1), 1)
    return before.bool() & mask


def train_dflash(model: str | None, out: str, block_size: int = 4, layers: int = 1, heads: int = 4,
                 steps: int = 1000, batch: int = 256, lr: float = 2e-3, max_tokens: int = 128,
                 temperature: float = 0.0, seed: int = 0, prompts: list[str] | None = None,
                 **engine_kw) -> DFlashReport:
    d = distill("train-dflash", model, prompts, max_tokens, temperature, seed, **engine_kw)
    V, H = d.W.shape
    K = block_size
    held = d.held  # a tenth held out for the report, a tenth to calibrate the acceptance head
    cal = 2 * held if len(d.seqs) > 2 * held else held
    h_tr, e_tr, y_tr, m_tr = _examples(d, slice(cal, None), K)
    h_te, e_te, y_te, m_te = _examples(d, slice(None, held), K)
    h_ca, e_ca, y_ca, m_ca = _examples(d, slice(held, cal), K) if cal > held else (h_te, e_te, y_te, m_te)
    y_local = d.local(y_tr)

    cfg = BlockDrafterConfig(block_size=K, hidden_size=H, num_layers=layers, num_heads=heads,
                             intermediate_size=2 * H, vocab_size=V)
    drafter = BlockDrafter(cfg)
    with torch.no_grad():
        drafter.in_proj_weight[:, :H] = torch.eye(H)
        drafter.pos_embed.normal_(0, 0.02)
        for p in (drafter.qkv, drafter.up):
            p.normal_(0, H ** -0.5)
        drafter.attn_norm.fill_(1.0)
        drafter.mlp_norm.fill_(1.0)
        # the final norm starts as the target's scale (its hidden states are already normed: keep their size)
        drafter.norm.fill_(float(h_tr.pow(2).mean().sqrt()))

    def loss(pick: torch.Tensor) -> dict[str, torch.Tensor]:
        feat, _ = drafter(h_tr[pick], e_tr[pick])
        logits = feat @ d.W_train.T  # [b, K, v]
        y, m = y_local[pick], m_tr[pick]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none").view_as(y)
        return {"loss": (ce * m).sum() / m.sum().clamp(min=1)}

    n = h_tr.shape[0]
    fit("train-dflash", torch.optim.Adam(drafter.parameters(), lr=lr), steps, batch, n, loss)
    # The acceptance head, on sequences the drafter never saw (on its own training positions it is right far more
    # often than on new text, and an estimate learned there overstates acceptance several times).
    with torch.no_grad():
        feat, _ = drafter(h_ca, e_ca)
        correct = ((feat @ d.W.T).argmax(-1) == y_ca) & m_ca
        live = _prefix_ok(correct, m_ca)
        # start from the calibration set's mean acceptance per position
        rate = (correct & live).sum(0).float() / live.sum(0).clamp(min=1)
        drafter.accept_weight.zero_()
        drafter.accept_bias.fill_(float(torch.logit(rate.mean().clamp(1e-3, 1 - 1e-3))))
    feat, correct = feat.detach(), correct.float()

    def accept_loss(pick: torch.Tensor) -> dict[str, torch.Tensor]:
        acc = F.linear(feat[pick], drafter.accept_weight, drafter.accept_bias).squeeze(-1)
        bce = F.binary_cross_entropy_with_logits(acc, correct[pick], reduction="none")
        return {"loss": (bce * live[pick]).sum() / live[pick].sum().clamp(min=1)}

    fit("train-dflash", torch.optim.Adam([drafter.accept_weight, drafter.accept_bias], lr=lr), max(steps // 4, 1),
        batch, feat.shape[0], accept_loss, every=0)
    with torch.no_grad():
        feat, acc = drafter(h_te, e_te)
        pred = (feat @ d.W.T).argmax(-1)  # the full vocabulary, as serving sees it
        correct = (pred == y_te) & m_te
        top1 = [float(correct[:, j][m_te[:, j]].float().mean()) for j in range(K)]
        accepted = float(torch.cumprod(correct.float(), 1).sum(1).mean())
        estimated = float(torch.cumprod(torch.sigmoid(acc), 1).sum(1).mean())
    out_dir = drafter.save(out, {"base_model_name_or_path": model or "embedded"})
    return DFlashReport(out_dir, len(d.seqs), n + h_te.shape[0], d.seconds(), top1, accepted, estimated)


def add_train_dflash_parser(subparsers) -> None:
    p = add_trainer_parser(subparsers, "train-dflash", "Train a block drafter (method dflash) on a model's own "
                           "continuations.", __doc__, "block_drafter.safetensors", cmd_train_dflash)
    p.add_argument("--block-size", type=int, default=4, help="drafts per forward, K (default: %(default)s)")
    p.add_argument("--layers", type=int, default=1, help="(default: %(default)s)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default: %(default)s)")
    add_loop_args(p, steps=1000, batch=256, lr=2e-3)


def cmd_train_dflash(args: argparse.Namespace) -> int:
    r = train_dflash(args.model, args.out, args.block_size, args.layers, args.heads, args.steps, args.batch, args.lr,
                     args.max_tokens, args.temperature, args.seed)
    acc = ", ".join(f"{a:.2f}" for a in r.top1)
    print(f"wrote {r.out}: a block of {len(r.top1)} from {r.sequences} continuations ({r.positions} positions) in "
          f"{r.seconds:.0f} s; held-out top-1 per position {acc}; accepted prefix {r.accepted:.2f} per block "
          f"(estimated {r.estimated:.2f})")
    return 0
