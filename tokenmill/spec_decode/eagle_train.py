"""`tokenmill train-eagle`: an EAGLE-1 draft head (spec_decode/heads.py's `eagle` layout) for a model, trained on
the model's own continuations (self-distillation, spec_decode/self_distill.py: the corpus, features and loop the
trainers share).

The head reads, at position p, the embedding of token t_{p+1} and the target's final hidden state f_p, through
`fc [H, 2H]` and one Llama decoder layer (no input norm; transformers' LlamaDecoderLayer while training, the same
weights under tokenmill's paged attention when serving), and its output h_p both predicts t_{p+2} through the
target's frozen LM head and stands in for f_{p+1} when it drafts further (EAGLE's two losses: smooth-L1 regression
of h_p onto f_{p+1} plus 0.1 x cross-entropy, the latter over the tokens the corpus uses).
Sequences are trained whole with causal attention (teacher forcing on the target's features); a tenth is held out
for the report: top-1 of the first draft, and of the second when the head feeds itself its own output (what
serving does).

Written: `config.json` (a LlamaConfig of one layer, the target's shapes) and `model.safetensors` with `fc.weight`,
`fc.bias` and `layers.0.*` (no `embed_tokens`, no `lm_head`: the target's are used).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.hf_config import hf_get
from tokenmill.spec_decode.head_folder import write_folder
from tokenmill.spec_decode.self_distill import add_loop_args, add_trainer_parser, distill, embed, fit

_CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "vocab_size", "max_position_embeddings", "rope_parameters", "rope_theta",
                "rope_scaling")


@dataclass
class EagleReport:
    out: Path
    sequences: int
    positions: int
    seconds: float
    top1: float  # first draft, held-out
    top1_second: float  # second draft, fed the head's own output


def head_config(target_config) -> dict:
    """A one-layer LlamaConfig with the target's shapes (what spec_decode/heads.py reads back)."""
    from transformers import LlamaConfig

    kw = {k: v for k in _CONFIG_KEYS if (v := hf_get(target_config, k)) is not None}  # the keys vary by model
    cfg = LlamaConfig(**kw, num_hidden_layers=1, tie_word_embeddings=False, hidden_act="silu")
    d = cfg.to_dict()
    d.update(model_type="llama", architectures=["EagleHead"], torch_dtype="float32")
    return d


class TrainableEagle(nn.Module):
    """fc + one LlamaDecoderLayer without its input norm, on whole sequences (causal)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in ("model_type", "architectures")})
        cfg._attn_implementation = "sdpa"
        H = cfg.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=True)
        self.layer = LlamaDecoderLayer(cfg, layer_idx=0)
        self.layer.input_layernorm = nn.Identity()
        self.rotary = LlamaRotaryEmbedding(cfg)

    def forward(self, emb: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """emb, feat [B, T, H] (embedding of t_{p+1}, feature f_p) -> h [B, T, H]."""
        x = self.fc(torch.cat([emb, feat], -1))
        pos = torch.arange(x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)
        out = self.layer(x, attention_mask=None, position_ids=pos, position_embeddings=self.rotary(x, pos))
        return out[0] if isinstance(out, tuple) else out

    def state(self) -> dict[str, torch.Tensor]:
        t = {"fc.weight": self.fc.weight, "fc.bias": self.fc.bias}
        t.update({f"layers.0.{k}": v for k, v in self.layer.state_dict().items()})
        return {k: v.detach().float().contiguous().clone() for k, v in t.items()}


def _pad(xs: list[torch.Tensor]) -> torch.Tensor:
    T = max(x.shape[0] for x in xs)
    return torch.stack([F.pad(x, (0,) * (2 * x.dim() - 1) + (T - x.shape[0],)) for x in xs])


def train_eagle(model: str | None, out: str, steps: int = 400, batch: int = 4, lr: float = 1e-3,
                max_tokens: int = 128, temperature: float = 0.0, seed: int = 0, prompts: list[str] | None = None,
                **engine_kw) -> EagleReport:
    d = distill("train-eagle", model, prompts, max_tokens, temperature, seed, **engine_kw)
    seqs, feats, W = d.seqs, d.feats, d.W
    embs = [embed(d.llm, torch.tensor(s)) for s, _ in seqs]
    H = W.shape[1]
    config = head_config(d.llm.engine.core.executor.worker.runner.model.config)
    head = TrainableEagle(config)
    with torch.no_grad():  # start near "pass the feature through": fc keeps f_p, the layer adds little
        head.fc.weight.zero_()
        head.fc.weight[:, H:] = torch.eye(H)
        head.fc.bias.zero_()
        for name, p in head.layer.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(0.1)

    def example(i: int):
        """(emb of t_{p+1}, f_p, f_{p+1}, t_{p+2}, loss mask) for p = 0 .. L-3, the mask on the continuation."""
        seq, plen = seqs[i]
        L = len(seq)
        tok = torch.tensor(seq)
        mask = torch.zeros(L - 2, dtype=torch.uint8)
        mask[max(plen - 2, 0):] = 1
        return embs[i][1 : L - 1], feats[i][: L - 2], feats[i][1 : L - 1], tok[2:L], mask

    held = d.held

    def loss(pick: torch.Tensor) -> dict[str, torch.Tensor]:  # whole sequences: pick j is sequence held + j
        e, f, f_next, y, m = (_pad(list(x)) for x in zip(*(example(held + j) for j in pick.tolist())))
        h = head(e, f)
        m = m.bool()
        reg = F.smooth_l1_loss(h[m], f_next[m])
        ce = F.cross_entropy(h[m] @ d.W_train.T, d.local(y[m]))
        return {"loss": reg + 0.1 * ce, "reg": reg, "ce": ce}

    fit("train-eagle", torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0), steps, batch,
        len(seqs) - held, loss, every=50, show="regression {reg:.4f}, cross-entropy {ce:.3f}")
    with torch.no_grad():  # held out: the first draft, and the second fed the head's own output
        right1 = right2 = n1 = n2 = 0
        for i in range(held):
            e, f, _, y, m = (x.unsqueeze(0) for x in example(i))
            m = m.bool()
            h = head(e, f)[0]
            pred1 = (h @ W.T).argmax(-1)
            right1 += int((pred1 == y[0])[m[0]].sum())
            n1 += int(m[0].sum())
            # second draft at p + 1: token = the first draft, feature = h_p (positions shifted by one)
            e2 = torch.cat([e[0, :1], embed(d.llm, pred1[:-1])], 0).unsqueeze(0)
            f2 = torch.cat([f[0, :1], h[:-1]], 0).unsqueeze(0)
            pred2 = (head(e2, f2)[0] @ W.T).argmax(-1)[1:]
            ok = m[0, 1:] & (pred1[:-1] == y[0, :-1])
            right2 += int((pred2 == y[0, 1:])[ok].sum())
            n2 += int(ok.sum())
    out_dir = write_folder(out, "model.safetensors", head.state(),
                           {**config, "base_model_name_or_path": model or "embedded"})
    positions = sum(len(s) - p for s, p in seqs)
    return EagleReport(out_dir, len(seqs), positions, d.seconds(), right1 / max(n1, 1), right2 / max(n2, 1))


def add_train_eagle_parser(subparsers) -> None:
    p = add_trainer_parser(subparsers, "train-eagle", "Train an EAGLE-1 draft head on a model's own continuations.",
                           __doc__, "model.safetensors", cmd_train_eagle)
    add_loop_args(p, steps=400, batch=4, lr=1e-3, per="sequences")


def cmd_train_eagle(args: argparse.Namespace) -> int:
    r = train_eagle(args.model, args.out, args.steps, args.batch, args.lr, args.max_tokens, args.temperature,
                    args.seed)
    print(f"wrote {r.out}: an EAGLE head from {r.sequences} continuations ({r.positions} positions) in "
          f"{r.seconds:.0f} s; held-out top-1 {r.top1:.2f} (first draft), {r.top1_second:.2f} (second, on its own "
          f"feature)")
    return 0
