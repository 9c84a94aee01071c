"""Reference paged-attention backend on torch SDPA (CPU, or any device).

Requests are split into groups, decodes (one query each) and prompt chunks of similar length (within
a factor of 2); each group is one padded SDPA call whose keys are gathered from the paged cache
through the block tables.
A boolean mask gives causality within a chunk, the cached prefix before it, the per-request
KV length and, per layer, the sliding window. Splitting the groups keeps a long prompt chunk from
padding every decode row to its length.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenmill.layers.attention_backends.base import AttentionBackend, BatchLayout


@dataclass
class SDPAGroup:
    token_index: torch.Tensor  # [B, Q] index into the packed batch (0 where padded)
    valid: torch.Tensor  # [B, Q]
    flat_index: torch.Tensor  # [N] token_index[valid]
    block_tables: torch.Tensor  # [B, NB]
    q_pos: torch.Tensor  # [B, Q] absolute position of each query (0 where padded)
    key_pos: torch.Tensor  # [L] = arange(NB * block_size)
    all_valid: bool
    _masks: dict = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor:
        m = self._masks.get(window)
        if m is None:
            q = self.q_pos.unsqueeze(-1)  # [B, Q, 1]
            k = self.key_pos.view(1, 1, -1)
            m = k <= q  # causal; also bounds each request's keys (q_pos < kv_len)
            if window is not None:
                m &= k > q - window
            m = m.unsqueeze(1)  # [B, 1, Q, L]
            self._masks[window] = m
        return m


@dataclass
class SDPAMetadata:
    slot_mapping: torch.Tensor
    groups: list[SDPAGroup]


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"

    def build_metadata(self, layout: BatchLayout, block_size: int, device: torch.device) -> SDPAMetadata:
        is_decode = layout.query_len == 1
        groups = []
        decodes = is_decode.nonzero().flatten()
        if decodes.numel():
            groups.append(self._group(layout, decodes, block_size, device))
        chunks = (~is_decode).nonzero().flatten()
        if chunks.numel():
            # Prefix-cache hits put short prompt tails next to long uncomputed prompts; one group would
            # pad every tail to the longest chunk. Chunks within a factor of 2 of each other share a group.
            bucket = torch.log2(layout.query_len[chunks].double()).ceil().long()
            for b in bucket.unique().tolist():
                groups.append(self._group(layout, chunks[bucket == b], block_size, device))
        return SDPAMetadata(slot_mapping=layout.slot_mapping.to(device), groups=groups)

    @staticmethod
    def _group(layout: BatchLayout, idx: torch.Tensor, block_size: int, device) -> SDPAGroup:
        q_start = layout.query_start[idx]
        q_len = layout.query_len[idx]
        kv_len = layout.kv_len[idx]
        Q = int(q_len.max())
        num_blocks = -(-int(kv_len.max()) // block_size)
        tables = torch.zeros(len(idx), num_blocks, dtype=torch.long)
        for row, i in enumerate(idx.tolist()):
            ids = layout.block_tables[i][:num_blocks]
            tables[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        ar = torch.arange(Q)
        valid = ar.unsqueeze(0) < q_len.unsqueeze(1)
        token_index = torch.where(valid, q_start.unsqueeze(1) + ar, 0)
        q_pos = torch.where(valid, (kv_len - q_len).unsqueeze(1) + ar, 0)
        return SDPAGroup(
            token_index=token_index.to(device),
            valid=valid.to(device),
            flat_index=token_index[valid].to(device),
            block_tables=tables.to(device),
            q_pos=q_pos.to(device),
            key_pos=torch.arange(num_blocks * block_size, device=device),
            all_valid=bool(valid.all()),
        )

    def forward(self, q, k_cache, v_cache, meta: SDPAMetadata, sliding_window: int | None, scale: float) -> torch.Tensor:
        """q: [T, H, D]; caches: [num_blocks, block_size, Hk, D]. Returns [T, H, D]."""
        out = torch.empty_like(q)
        num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
        for g in meta.groups:
            B, NB = g.block_tables.shape
            Q = g.token_index.shape[1]
            qg = q.index_select(0, g.token_index.view(-1)).view(B, Q, num_heads, -1).transpose(1, 2)  # [B, H, Q, D]
            # index_select over whole blocks is ~4x faster than advanced indexing on CPU.
            flat = g.block_tables.view(-1)
            kg = k_cache.index_select(0, flat).view(B, -1, num_kv_heads, k_cache.shape[-1]).transpose(1, 2).to(q.dtype)
            vg = v_cache.index_select(0, flat).view(B, -1, num_kv_heads, v_cache.shape[-1]).transpose(1, 2).to(q.dtype)
            o = F.scaled_dot_product_attention(
                qg, kg, vg, attn_mask=g.mask(sliding_window), scale=scale, enable_gqa=num_heads != num_kv_heads
            ).transpose(1, 2)  # [B, Q, H, D]
            if g.all_valid:
                out.index_copy_(0, g.flat_index, o.flatten(0, 1))
            else:
                out.index_copy_(0, g.flat_index, o[g.valid])
        return out
