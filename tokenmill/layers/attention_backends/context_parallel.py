"""Context parallelism: every sequence's K/V split over N ranks by block (`--decode-context-parallel-size N`), and
optionally the step's tokens too (`--prefill-context-parallel-size N`).

The core allocates blocks from one pool of N x P blocks as usual; global block b lives on rank b % N as its
local block b // N, so a long context's blocks spread over the ranks (the pool's LRU hands them out in
turns) and each rank holds 1/N of the K/V. In each attention layer a rank writes the new K/V whose blocks it
owns, attends every query to the keys it holds (torch_sdpa's groups with each request's table cut to the blocks
the rank owns; torch's CPU flash kernel, which also returns each row's log-sum-exp); then the ranks all-gather
(out, lse) and merge: out = sum_r exp(lse_r - m) out_r / sum_r exp(lse_r - m), m = max_r lse_r, exactly the
full attention's up to summation order.

Decode context parallelism alone: every rank runs the whole model on every token of the step (weights
replicated, or split by tensor parallelism over other ranks), so it buys K/V memory and attention reads per
rank / N, not matmul time. Prefill context parallelism also splits the step's tokens (`TokenSplit`): rank r runs
the matmuls of rows [r*n, (r+1)*n), n = ceil(T / N) (the last share padded), and in each attention layer the
ranks all-gather the step's q, k, v so that every rank writes the K/V of its blocks and attends all queries to
its keys, as above; after the merge a rank keeps its own rows. The K/V held in the paged pools never moves:
queries travel to the keys (the "pass-Q" side of ring attention). A ring passing K/V instead would move the
whole cached context every step of a chunked prefill, while the step's q, k, v are bounded by the token budget.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tokenmill.layers import collectives
from tokenmill.layers.attention_backends.base import BatchLayout
from tokenmill.layers.attention_backends.torch_sdpa import SDPAGroup, SDPAMetadata, TorchSDPABackend


@dataclass(frozen=True)
class TokenSplit:
    """Prefill context parallelism's share of a step's T tokens: rank r holds rows [r*n, (r+1)*n), n = ceil(T/N);
    rows past T are padding (zeros), so every rank's share has the same shape for the all-gathers."""

    rank: int
    size: int

    def share(self, num_tokens: int) -> tuple[int, int]:
        """(first row, rows) of this rank's share."""
        n = -(-num_tokens // self.size)
        return self.rank * n, n

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a [T, ...] tensor, padded with zeros to the share's size."""
        lo, n = self.share(x.shape[0])
        piece = x[lo:lo + n]
        if piece.shape[0] == n:
            return piece
        return torch.cat([piece, piece.new_zeros((n - piece.shape[0], *x.shape[1:]))])

    def gather(self, x: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Every rank's share back in token order: [n, ...] -> [T, ...]."""
        return collectives.all_gather_rows(x)[:num_tokens]


@dataclass
class ContextParallelMetadata(SDPAMetadata):
    write_rows: torch.Tensor | None = None  # [W] rows of the step's K/V whose blocks this rank owns
    num_tokens: int = 0  # T: the step's tokens (all ranks')


class ContextParallelBackend(TorchSDPABackend):
    name = "torch_sdpa_context_parallel"
    supports_sinks = True  # each head's sink joins the merged denominator once (forward)

    def __init__(self, block_size: int, device: torch.device, rank: int, size: int,
                 split_tokens: bool = False) -> None:
        super().__init__(block_size, device)
        self.rank, self.size = rank, size
        self.token_split = TokenSplit(rank, size) if split_tokens else None
        self._table: torch.Tensor | None = None  # [B, max blocks]: the layout being built, global block ids
        self._owned: torch.Tensor | None = None  # [B, max blocks]: which of them this rank holds

    def build_metadata(self, layout: BatchLayout) -> ContextParallelMetadata:
        """The layout in this rank's local blocks: the table's entries it owns (0 elsewhere, masked), and the
        slots of the new tokens whose blocks it owns (`write_rows`: their rows of the step's K/V)."""
        N, bs = self.size, self.block_size
        table = layout.block_table.long()
        self._table, self._owned = table, table % N == self.rank
        slots = layout.slot_mapping.long()
        block = slots // bs
        mine = block % N == self.rank
        local = replace(layout, block_table=torch.where(self._owned, table // N, 0),
                        slot_mapping=((block // N) * bs + slots % bs)[mine])
        meta = super().build_metadata(local)
        return ContextParallelMetadata(meta.slot_mapping, meta.groups, mine.nonzero().flatten().to(self.device),
                                       int(slots.shape[0]))

    def _group(self, layout: BatchLayout, idx: torch.Tensor) -> SDPAGroup:
        """torch_sdpa's group with each request's keys cut to the blocks this rank owns: the table compacted to
        them (in order), their positions per request (`key_pos` [B, L]), padding masked (`key_owned`)."""
        g = super()._group(layout, idx)
        bs, nb = self.block_size, g.block_tables.shape[1]
        owned = self._owned[idx, :nb]
        keep = max(int(owned.sum(1).max()), 1)
        order = torch.argsort((~owned).to(torch.int8), dim=1, stable=True)[:, :keep]  # owned blocks first, in order
        held = torch.gather(owned, 1, order)
        blocks = torch.gather(self._table[idx, :nb], 1, order)
        g.block_tables = torch.where(held, blocks // self.size, 0).to(self.device)
        g.key_pos = (order.unsqueeze(-1) * bs + torch.arange(bs)).flatten(1).to(self.device)
        g.key_owned = held.repeat_interleave(bs, dim=1).to(self.device)
        return g

    def forward(self, layer, q, k, v, meta: ContextParallelMetadata) -> torch.Tensor:
        k_cache, v_cache = layer.k_cache, layer.v_cache
        Hk, D = k_cache.shape[2], k_cache.shape[3]
        split = self.token_split
        if split is not None:  # this rank's rows in; every rank needs the step's q (to its keys) and k, v (its blocks)
            H = q.shape[1]
            qkv = split.gather(torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1), meta.num_tokens)
            q, k, v = (t.view(-1, h, D) for t, h in zip(qkv.split([H * D, Hk * D, Hk * D], dim=1), (H, Hk, Hk)))
        rows = meta.write_rows
        k_cache.view(-1, Hk, D).index_copy_(0, meta.slot_mapping, k.index_select(0, rows).to(k_cache.dtype))
        v_cache.view(-1, Hk, D).index_copy_(0, meta.slot_mapping, v.index_select(0, rows).to(v_cache.dtype))
        T, H = q.shape[0], q.shape[1]
        out = torch.zeros(T, H, D, dtype=torch.float32, device=q.device)
        lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
        for g in meta.groups:
            B, _ = g.block_tables.shape
            Q = g.token_index.shape[1]
            qg = q.index_select(0, g.token_index.view(-1)).view(B, Q, H, D).transpose(1, 2).float()  # [B, H, Q, D]
            flat = g.block_tables.view(-1)
            kg = k_cache.index_select(0, flat).view(B, -1, Hk, D).transpose(1, 2).float()
            vg = v_cache.index_select(0, flat).view(B, -1, Hk, D).transpose(1, 2).float()
            if H != Hk:
                kg, vg = kg.repeat_interleave(H // Hk, dim=1), vg.repeat_interleave(H // Hk, dim=1)
            o, part_lse = _partial_attention(qg, kg, vg, g.mask(layer.sliding_window), layer.scale,
                                             layer.logits_soft_cap)
            o = o.transpose(1, 2)  # [B, Q, H, D]
            part_lse = part_lse.transpose(1, 2)  # [B, Q, H]
            out.index_copy_(0, g.flat_index, o[g.valid])
            lse.index_copy_(0, g.flat_index, part_lse[g.valid])
        outs, lses = collectives.all_gather_stack([out, lse])
        if split is not None:  # merge this rank's rows only
            lo, n = split.share(T)
            outs, lses = outs[:, lo:lo + n], lses[:, lo:lo + n]
        m = lses.max(dim=0).values  # [T, H]: finite, the owner of a row's own key holds at least that key
        w = torch.exp(lses - m)  # [N, T, H]
        denominator = w.sum(0)
        if layer.sinks is not None:  # gpt-oss: each head's sink once, over all ranks' keys
            denominator = denominator + torch.exp(layer.sinks.float() - m)
        merged = (w.unsqueeze(-1) * outs).sum(0) / denominator.unsqueeze(-1)
        if split is not None and merged.shape[0] < n:  # the padding rows of the last share
            merged = torch.cat([merged, merged.new_zeros(n - merged.shape[0], H, D)])
        return merged.to(q.dtype)


def _partial_attention(q, k, v, mask, scale: float, cap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the keys `mask` lets through ([B, 1, Q, L]) and each row's log-sum-exp [B, H, Q]: -inf (and a
    zero output) where a row has none. On the CPU without a soft cap, torch's flash kernel, which returns both;
    else in plain torch."""
    empty = ~mask.any(-1)  # [B, 1, Q]
    if cap is None and q.device.type == "cpu":
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias,
                                                                            scale=scale)
        return o, lse.masked_fill(empty, float("-inf"))
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(scores.dtype).min))
    return torch.matmul(probs, v), lse
