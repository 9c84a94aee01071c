"""Block drafting (`method: "dflash"`): a small drafter that emits a block of K draft tokens in one forward, all K
positions in parallel and conditioned on the target's hidden state, after DFlash (block drafting in one pass) with
DSpark's idea of estimating, per position, whether the block is still being accepted there, so only the part
worth verifying is sent.

No published checkpoint layout exists for these drafters, so tokenmill defines one (docs/speculative.md), written
by `tokenmill train-dflash` (spec_decode/dflash_train.py). A folder with `config.json`:

    {"tokenmill_block_drafter": 1, "block_size": K, "hidden_size": H, "num_layers": L, "num_heads": n,
     "intermediate_size": I, "rms_norm_eps": 1e-6, "vocab_size": V}

and `block_drafter.safetensors` holding
    in_proj.weight [H, 2H], in_proj.bias [H]    x_j = in_proj([h ; e]) + pos_embed[j], j < K
    pos_embed [K, H]                           (h: the target's final hidden state at the row that produced the
                                                last token t, e: the target's embedding of t)
    layers.{l}.attn_norm.weight [H]            L blocks over the K positions: bidirectional self-attention
    layers.{l}.qkv.weight [3H, H]              (every position sees the whole block: the draft tokens are not
    layers.{l}.o.weight [H, H]                  known inside the forward, so order carries no information)
    layers.{l}.mlp_norm.weight [H]             and a SiLU MLP, pre-norm, residual
    layers.{l}.up.weight [I, H], layers.{l}.down.weight [H, I]
    norm.weight [H]                            then the target's own LM head: logits for tokens t+1 .. t+K
    accept.weight [1, H], accept.bias [1]      optional: sigmoid(accept(norm(x_j))) estimates P(draft j is
                                                accepted | the drafts before it were)

The block sent for verification is its longest prefix whose estimated acceptance (the product of the per-position
estimates; without an accept head, of the drafter's own top probabilities) stays at or above `block_threshold`,
at least one draft and at most the k the adaptive policy allows. Drafts are point masses (each position's top
token), verified as a chain, so greedy and sampled output stay exact whatever the drafter proposes. Unlike
DFlash's drafter, this one reads the target's last hidden state only (no K/V of its own over the context): a
lookup-kind proposer, one batched call per step.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.spec_decode.draft import Draft, StepView
from tokenmill.spec_decode.head_folder import fill, find_weights, load_state, read_config, write_folder

WEIGHTS = "block_drafter.safetensors"
MARKER = "tokenmill_block_drafter"


@dataclass(frozen=True)
class BlockDrafterConfig:
    block_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6

    def to_json(self) -> dict:
        return {MARKER: 1, **self.__dict__}


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class BlockDrafter(nn.Module):
    """One forward: (h [B, H], e [B, H]) -> (features [B, K, H] after the final norm, acceptance logits [B, K] or
    None). Trainable as is (dflash_train.py) and served frozen."""

    def __init__(self, cfg: BlockDrafterConfig, dtype: torch.dtype = torch.float32, accept: bool = True) -> None:
        super().__init__()
        H, K, L, I = cfg.hidden_size, cfg.block_size, cfg.num_layers, cfg.intermediate_size
        if H % cfg.num_heads:
            raise ValueError(f"dflash: hidden_size {H} is not a multiple of num_heads {cfg.num_heads}")
        self.cfg = cfg
        p = lambda *shape: nn.Parameter(torch.zeros(*shape, dtype=dtype))  # noqa: E731
        self.in_proj_weight, self.in_proj_bias, self.pos_embed = p(H, 2 * H), p(H), p(K, H)
        self.attn_norm, self.qkv, self.o = p(L, H), p(L, 3 * H, H), p(L, H, H)
        self.mlp_norm, self.up, self.down = p(L, H), p(L, I, H), p(L, H, I)
        self.norm = p(H)
        self.accept_weight, self.accept_bias = (p(1, H), p(1)) if accept else (None, None)

    def forward(self, h: torch.Tensor, e: torch.Tensor, k: int | None = None):
        cfg = self.cfg
        K = cfg.block_size if k is None else k
        B, H, n = h.shape[0], cfg.hidden_size, cfg.num_heads
        dt = self.in_proj_weight.dtype
        x = F.linear(torch.cat([h.to(dt), e.to(dt)], -1), self.in_proj_weight, self.in_proj_bias)
        x = x.unsqueeze(1) + self.pos_embed[:K]  # [B, K, H]
        eps = cfg.rms_norm_eps
        for l in range(cfg.num_layers):
            q, kk, v = F.linear(_rms(x, self.attn_norm[l], eps), self.qkv[l]).view(B, K, 3, n, H // n).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), v.transpose(1, 2))
            x = x + F.linear(a.transpose(1, 2).reshape(B, K, H), self.o[l])
            x = x + F.linear(F.silu(F.linear(_rms(x, self.mlp_norm[l], eps), self.up[l])), self.down[l])
        out = _rms(x, self.norm, eps)
        acc = F.linear(out, self.accept_weight, self.accept_bias).squeeze(-1) if self.accept_weight is not None else None
        return out, acc

    # ---- the layout -------------------------------------------------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        """The tensors by their published names."""
        t = {"in_proj.weight": self.in_proj_weight, "in_proj.bias": self.in_proj_bias, "pos_embed": self.pos_embed,
             "norm.weight": self.norm}
        for l in range(self.cfg.num_layers):
            for name, p in (("attn_norm.weight", self.attn_norm), ("qkv.weight", self.qkv), ("o.weight", self.o),
                            ("mlp_norm.weight", self.mlp_norm), ("up.weight", self.up), ("down.weight", self.down)):
                t[f"layers.{l}.{name}"] = p[l]
        if self.accept_weight is not None:
            t["accept.weight"], t["accept.bias"] = self.accept_weight, self.accept_bias
        return t

    def save(self, folder: str | Path, extra: dict | None = None) -> Path:
        return write_folder(folder, WEIGHTS, self.state(), {**self.cfg.to_json(), **(extra or {})})


def load_block_drafter(path: str, hidden: int, vocab: int, dtype: torch.dtype) -> BlockDrafter:
    """The drafter of a folder in the layout above, checked against the target's hidden size and vocabulary."""
    folder = Path(path)
    raw = read_config(folder, "dflash", "the block drafter layout, docs/speculative.md")
    if not raw.get(MARKER):
        raise ValueError(f"dflash: {folder / 'config.json'} is not a tokenmill block drafter (no {MARKER!r}); "
                         "write one with `tokenmill train-dflash`.")
    names = BlockDrafterConfig.__dataclass_fields__
    try:
        cfg = BlockDrafterConfig(**{k: raw[k] for k in names if k in raw})
    except TypeError as e:
        raise ValueError(f"dflash: {folder / 'config.json'}: {e}") from None
    if cfg.hidden_size != hidden or cfg.vocab_size != vocab:
        raise ValueError(f"dflash: the drafter is for hidden size {cfg.hidden_size} and vocabulary {cfg.vocab_size}, "
                         f"the target has {hidden} and {vocab}.")
    state = load_state(find_weights(folder, (WEIGHTS,), "dflash"))
    drafter = BlockDrafter(cfg, dtype, accept="accept.weight" in state)
    fill("dflash", WEIGHTS, state, drafter.state())
    drafter.requires_grad_(False)
    return drafter


def block_lengths(estimates: torch.Tensor, threshold: float, k: int) -> torch.Tensor:
    """DSpark's cut: per request, the longest prefix of the block whose estimated acceptance (the running product
    of the per-position estimates [B, K]) stays >= threshold; at least 1 and at most k. [B] on their device."""
    keep = (torch.cumprod(estimates.float(), dim=1) >= threshold).sum(1)
    return keep.clamp(1, k)


class BlockDrafterProposer:
    """A lookup-kind drafter (one batched call per step over the rows the target just computed)."""

    shape = "block"  # what its k means to the adaptive policy (adaptive.py)

    def __init__(self, drafter: BlockDrafter, embed, lm_head, threshold: float) -> None:
        self.drafter = drafter
        self.embed = embed  # token ids [B] -> the target's embeddings [B, H]
        self.lm_head = lm_head  # [N, H] -> float32 logits [N, V]
        self.threshold = threshold

    def forget(self, rid: str) -> None:
        pass

    @torch.inference_mode()
    def propose(self, view: StepView, want: set[int], k: int) -> dict[int, Draft]:
        if not want or view.hidden is None:
            return {}
        order = sorted(want)
        dev = view.hidden.device
        rows = torch.tensor([view.source_row(i) for i in order], device=dev)
        last = torch.tensor([view.accepted[i][-1] for i in order], device=dev)
        K = min(k, self.drafter.cfg.block_size)
        feats, acc = self.drafter(view.hidden.index_select(0, rows), self.embed(last), K)
        B = len(order)
        logits = self.lm_head(feats.reshape(B * K, -1).to(view.hidden.dtype)).float().view(B, K, -1)
        if acc is not None:
            est = torch.sigmoid(acc.float())
            tokens = logits.argmax(-1)
        else:  # the drafter's own confidence
            top = logits.softmax(-1).max(-1)
            est, tokens = top.values, top.indices
        # the block and its cut reach the host in one copy
        host = torch.cat([tokens, block_lengths(est, self.threshold, K).unsqueeze(1)], 1).cpu().tolist()
        return {i: Draft(row[: row[K]], None) for i, row in zip(order, host)}
