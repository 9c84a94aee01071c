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
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tokenmill.layers.attention_backends import kv_quant
from tokenmill.layers.attention_backends.base import AttentionBackend, BatchLayout
from tokenmill.layers.attention_backends.registry import register_backend

if TYPE_CHECKING:
    from tokenmill.layers.attention import Attention


@dataclass
class SDPAGroup:
    token_index: torch.Tensor  # [B, Q] index into the packed batch (0 where padded)
    valid: torch.Tensor  # [B, Q]
    flat_index: torch.Tensor  # [N] token_index[valid]
    block_tables: torch.Tensor  # [B, NB]
    q_pos: torch.Tensor  # [B, Q] absolute position of each query (0 where padded)
    key_pos: torch.Tensor  # [L] = arange(NB * block_size); or [B, L], each request's own key positions
    all_valid: bool
    key_owned: torch.Tensor | None = None  # [B, L] context parallelism: keys this rank holds (None: all)
    tree_ok: torch.Tensor | None = None  # [B, Q, L] draft trees: False where a node may not see a key
    key_valid: torch.Tensor | None = None  # [B, L] keys below each request's kv_len (set for unzeroed caches)
    _masks: dict = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor:
        m = self._masks.get(window)
        if m is None:
            q = self.q_pos.unsqueeze(-1)  # [B, Q, 1]
            k = self.key_pos.view(1, 1, -1) if self.key_pos.dim() == 1 else self.key_pos.unsqueeze(1)
            m = k <= q  # causal; also bounds each request's keys (q_pos < kv_len)
            if window is not None:
                m &= k > q - window
            if self.key_owned is not None:
                m &= self.key_owned.unsqueeze(1)
            if self.tree_ok is not None:
                m &= self.tree_ok
            m = m.unsqueeze(1)  # [B, 1, Q, L]
            self._masks[window] = m
        return m


@dataclass
class SDPAMetadata:
    slot_mapping: torch.Tensor  # [T] on the backend's device
    groups: list[SDPAGroup]


@register_backend
class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"
    supports_sinks = True

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        return True

    def __init__(self, block_size: int, device: torch.device) -> None:
        super().__init__(block_size, device)
        self.layers: list[Attention] = []
        self.initialized = torch.zeros(0, dtype=torch.bool)  # [num_blocks] on CPU: zeroed or written from outside
        self.num_uninitialized = 0

    def kv_cache_shape(self, num_blocks: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, num_kv_heads, head_dim)

    def allocate_kv_cache(self, layers: list[Attention], num_blocks: int, dtype: torch.dtype) -> None:
        self.check_layers(layers, dtype)
        for a in layers:
            shape = self.kv_cache_shape(num_blocks, a.num_kv_heads, a.head_dim)
            # Not zeroed here (4 GiB of memset takes seconds): build_metadata zeroes each block on first use.
            kv_quant.allocate(a, shape, dtype, self.device)
            a.backend = self
        self.layers = list(layers)
        self.initialized = torch.zeros(num_blocks, dtype=torch.bool)
        self.num_uninitialized = num_blocks

    def mark_initialized(self, block_ids: torch.Tensor) -> None:
        ids = block_ids.to("cpu", torch.long).flatten()
        self.initialized[ids] = True
        self.num_uninitialized = int((~self.initialized).sum())

    def _zero_new_blocks(self, block_table: torch.Tensor) -> None:
        """Unwritten slots are read (and masked) by attention; NaN garbage there would survive the
        mask, so every block a step references (padding block 0 included) is zeroed the first time."""
        if self.num_uninitialized == 0:
            return
        ids = block_table.to("cpu", torch.long).flatten()
        fresh = ids[~self.initialized[ids]]
        if fresh.numel() == 0:
            return
        fresh = fresh.unique()
        dev_ids = fresh.to(self.device)
        for a in self.layers:
            kv_quant.zero_blocks(a, dev_ids)
        self.initialized[fresh] = True
        self.num_uninitialized -= fresh.numel()

    def _check_bounds(self, layout: BatchLayout) -> None:
        """Block ids and slots within the pool, checked before anything is indexed: a negative id would wrap
        around silently, and on CUDA an out-of-range one is a device assert that kills the process. The
        tables are built on the CPU, so this costs no device sync (a min/max over a few thousand ints)."""
        num_blocks = self.initialized.numel()
        if num_blocks == 0:
            return  # no pool of its own (a kernel test hands it caches directly)
        for name, t, hi in (("block table", layout.block_table, num_blocks),
                            ("slot mapping", layout.slot_mapping, num_blocks * self.block_size)):
            if t.numel() and t.device.type == "cpu":
                lo_v, hi_v = torch.aminmax(t)
                if int(lo_v) < 0 or int(hi_v) >= hi:
                    raise IndexError(f"{name} holds {int(lo_v)}..{int(hi_v)}, outside the KV pool [0, {hi}).")

    def build_metadata(self, layout: BatchLayout) -> SDPAMetadata:
        self._check_bounds(layout)
        self._zero_new_blocks(layout.block_table)
        is_decode = layout.query_len == 1
        groups = []
        decodes = is_decode.nonzero().flatten()
        if decodes.numel():
            groups.append(self._group(layout, decodes))
        chunks = (~is_decode).nonzero().flatten()
        if chunks.numel():
            # Prefix-cache hits put short prompt tails next to long uncomputed prompts; one group would
            # pad every tail to the longest chunk. Chunks within a factor of 2 of each other share a group.
            bucket = torch.log2(layout.query_len[chunks].double()).ceil().long()
            for b in bucket.unique().tolist():
                groups.append(self._group(layout, chunks[bucket == b]))
        return SDPAMetadata(slot_mapping=layout.slot_mapping.to(self.device, torch.long), groups=groups)

    def _group(self, layout: BatchLayout, idx: torch.Tensor) -> SDPAGroup:
        return sdpa_group(layout, idx, self.block_size, self.device)

    def forward(self, layer: Attention, q, k, v, meta: SDPAMetadata) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hk, D]; caches: [num_blocks, block_size, Hk, D]. Returns [T, H, D]."""
        k_cache, v_cache = layer.k_cache, layer.v_cache
        num_heads, num_kv_heads, head_dim = q.shape[1], k_cache.shape[2], k_cache.shape[3]
        quantized = kv_quant.is_quantized(k_cache.dtype)
        if quantized:
            kv_quant.write_reference(layer, k, v, meta.slot_mapping)
        else:
            k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
            v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        out = torch.empty_like(q)
        for g in meta.groups:
            attend_group(layer, q, g, out)
        return out


def sdpa_group(layout: BatchLayout, idx: torch.Tensor, bs: int, device: torch.device) -> SDPAGroup:
    """The requests `idx` of the layout as one padded SDPA call: their queries, block tables, positions."""
    q_start = layout.query_start[idx]
    q_len = layout.query_len[idx]
    kv_len = layout.kv_len[idx]
    Q = int(q_len.max())
    num_blocks = -(-int(kv_len.max()) // bs)
    tables = layout.block_table[idx, :num_blocks].long()
    ar = torch.arange(Q)
    valid = ar.unsqueeze(0) < q_len.unsqueeze(1)
    token_index = torch.where(valid, q_start.unsqueeze(1) + ar, 0)
    q_pos = torch.where(valid, (kv_len - q_len).unsqueeze(1) + ar, 0)
    tree_ok = _tree_ok(layout, idx, q_len, kv_len, Q, num_blocks * bs)
    return SDPAGroup(
        token_index=token_index.to(device),
        valid=valid.to(device),
        flat_index=token_index[valid].to(device),
        block_tables=tables.to(device),
        q_pos=q_pos.to(device),
        key_pos=torch.arange(num_blocks * bs, device=device),
        all_valid=bool(valid.all()),
        tree_ok=tree_ok.to(device) if tree_ok is not None else None,
    )


def tree_group(layout: BatchLayout, bs: int, device: torch.device) -> SDPAGroup | None:
    """For a kernel that attends causally (cpu_paged, triton_paged) and never zeroes its pool: the requests
    verifying draft trees as one SDPA group, attended again with the tree mask, unwritten slots kept out of its
    gathered keys. None where no request verifies a tree."""
    if layout.tree_req is None:
        return None
    g = sdpa_group(layout, layout.tree_req, bs, device)
    g.key_valid = g.key_pos.unsqueeze(0) < layout.kv_len[layout.tree_req].to(device).unsqueeze(1)
    return g


def _tree_ok(layout: BatchLayout, idx: torch.Tensor, q_len, kv_len, Q: int, L: int) -> torch.Tensor | None:
    """[B, Q, L]: True but where a tree request's query may not see one of its step's own keys."""
    if layout.tree_req is None:
        return None
    member = idx.unsqueeze(1) == layout.tree_req.unsqueeze(0)  # [B, R]
    if not bool(member.any()):
        return None
    gb, r = member.nonzero(as_tuple=True)  # the group's rows that verify trees, and their trees
    nq = layout.tree_mask.shape[1]
    ar = torch.arange(nq)
    inside = ar.unsqueeze(0) < q_len[gb].unsqueeze(1)  # [G, nq]
    sel = inside.unsqueeze(2) & inside.unsqueeze(1)  # [G, nq, nq]
    G = gb.numel()
    rows = gb.view(G, 1, 1).expand(G, nq, nq)
    queries = ar.view(1, nq, 1).expand(G, nq, nq)
    keys = ((kv_len - q_len)[gb].view(G, 1, 1) + ar.view(1, 1, nq)).expand(G, nq, nq)
    ok = torch.ones(idx.numel(), Q, L, dtype=torch.bool)
    ok[rows[sel], queries[sel], keys[sel]] = layout.tree_mask[r][sel]
    return ok


def attend_group(layer: Attention, q: torch.Tensor, g: SDPAGroup, out: torch.Tensor) -> None:
    """One group's attention over the layer's paged cache, into its rows of `out`."""
    k_cache, v_cache = layer.k_cache, layer.v_cache
    num_heads, num_kv_heads, head_dim = q.shape[1], k_cache.shape[2], k_cache.shape[3]
    B, NB = g.block_tables.shape
    Q = g.token_index.shape[1]
    qg = q.index_select(0, g.token_index.view(-1)).view(B, Q, num_heads, -1).transpose(1, 2)  # [B, H, Q, D]
    # index_select over whole blocks is ~4x faster than advanced indexing on CPU.
    flat = g.block_tables.view(-1)
    if kv_quant.is_quantized(k_cache.dtype):
        kg, vg = kv_quant.gather_dequantized(layer, flat, q.dtype)
    else:
        kg, vg = k_cache.index_select(0, flat), v_cache.index_select(0, flat)
    kg = kg.view(B, -1, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    vg = vg.view(B, -1, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    mask = g.mask(layer.sliding_window)
    if g.key_valid is not None:  # a cache that is never zeroed: unwritten slots may hold anything
        seen = g.key_valid.view(B, 1, -1, 1)
        kg, vg = torch.where(seen, kg, 0.0), torch.where(seen, vg, 0.0)
    if layer.logits_soft_cap is None and layer.sinks is None:
        o = F.scaled_dot_product_attention(
            qg, kg, vg, attn_mask=mask, scale=layer.scale, enable_gqa=num_heads != num_kv_heads
        )
    else:
        o = plain_attention(qg, kg, vg, mask, layer.scale, layer.logits_soft_cap, layer.sinks)
    o = o.transpose(1, 2)  # [B, Q, H, D]
    if g.all_valid:
        out.index_copy_(0, g.flat_index, o.flatten(0, 1))
    else:
        out.index_copy_(0, g.flat_index, o[g.valid])


def plain_attention(q, k, v, mask, scale: float, cap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA has neither a soft cap (cap * tanh(scores / cap), as Gemma 2 uses) nor sinks (gpt-oss: a logit per
    head in the softmax's denominator, no value), so attend in plain torch. q [B, H, Q, D], k/v [B, Hk, L, D]."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(scores.softmax(-1), v)
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.matmul(probs, v)
