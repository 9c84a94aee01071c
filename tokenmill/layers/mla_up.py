"""MLA's up-projected form for prompt chunks, and the per-step rule that picks it over the absorbed form.

The absorbed form (layers/mla.py) scores each query against the latents: per head and (query, key) pair,
kv_lora_rank + qk_rope_head_dim multiply-adds for the score and kv_lora_rank for the weighted sum, plus, per query,
the W_UK and W_UV products (qk_nope * r + r * v). The up-projected form is the one transformers computes:
every key of the context up-projected from its cached latent (r * (qk_nope + v) per head and key, every step:
the cache holds latents only), then multi-head attention with qk_nope + qk_rope features a score and v a sum.
With V3's sizes (r 512, rope 64, nope 128, v 128), per head:

    absorbed:      pairs * 1088 + queries * 131072
    up-projected:  pairs *  320 + keys    * 131072

A decode (1 query, k keys) costs k * 1088 against k * 131392: absorbed. A fresh prompt of n tokens (n * (n + 1) / 2
pairs, n keys) has fewer up-projected FLOPs for every n > 1. But the absorbed form runs in the attention backend's
kernel and the up-projected one in torch matmuls, which do less per FLOP on the CPU: with V2-Lite's 16 heads
(benchmarks/mla.py --prefill, 2 threads) a 512-token prompt took 187 ms absorbed against 277 ms up-projected at a
FLOP ratio of 1.9, 1,024 tokens 602 against 514 ms (2.3), 2,048 tokens 1,793 against 1,513 ms (2.7). So the rule
sums both counts over the step's requests and up-projects when the absorbed count is above UP_MARGIN (2) times the
up-projected one: for V3's sizes, fresh prompts from ~590 tokens, and chunks of above ~590 tokens after a long
prefix (q > 262144 k / (448 k + 131072)). One form per step: the attention backend runs a whole step, so the
absorbed form cannot take some of its requests and the up-projected form the others; decodes beside a prompt
count (each would up-project its whole context).

The up-projected step writes the step's latents into the cache itself (the same slots the backend would), reads
each request's whole context back from the latent cache (prefix hits and earlier chunks included; int8 / fp8 caches
dequantized), up-projects it with kv_b_proj and runs causal SDPA over the padded requests. Steps the rule cannot
take run absorbed: draft-tree verification (its mask is not causal), context-parallel and pipeline stages and
CUDA-graph replays (no layout is handed over), and any forward outside the runner (drafts, MTP heads).

TOKENMILL_MLA_UP_PROJECT: `auto` (the rule, default), `never` (absorbed for every step), `always` (up-projected for
every step the rule could take, decodes included: for tests).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from tokenmill.layers.attention import Attention
    from tokenmill.layers.attention_backends.base import BatchLayout
    from tokenmill.layers.mla import MLASpec

MODE_ENV = "TOKENMILL_MLA_UP_PROJECT"
MODES = ("auto", "never", "always")
UP_MARGIN = 2.0  # up-project when absorbed FLOPs > UP_MARGIN x up-projected FLOPs (measured: the docstring)


def mode() -> str:
    value = os.environ.get(MODE_ENV, "auto")
    if value not in MODES:
        raise ValueError(f"{MODE_ENV}={value!r}: expected one of {', '.join(MODES)}.")
    return value


def step_costs(mla: MLASpec, query_len: list[int], kv_len: list[int]) -> tuple[int, int]:
    """(absorbed, up-projected) multiply-adds per head for a step's attention (the module docstring's formula)."""
    r, dr, dn, dv = mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim
    absorbed = up = 0
    for q, k in zip(query_len, kv_len):
        pairs = q * k - q * (q - 1) // 2  # causal: query j of the chunk sees k - q + j + 1 keys
        absorbed += pairs * (2 * r + dr) + q * (dn * r + r * dv)
        up += pairs * (dn + dr + dv) + k * r * (dn + dv)
    return absorbed, up


@dataclass
class MLAStep:
    """One model's choice for the current step, shared by its MLA layers: set by the runner before each forward
    (`DecoderForCausalLM.begin_step`)."""

    mla: MLASpec
    layout: BatchLayout | None = None  # set only when up-projecting this step
    mode: str = "auto"

    def set(self, layout: BatchLayout | None) -> None:
        self.layout = None
        if layout is None or layout.tree_req is not None or self.mode == "never":
            return
        if self.mode == "always":
            self.layout = layout
            return
        absorbed, up = step_costs(self.mla, layout.query_len.tolist(), layout.kv_len.tolist())
        if absorbed > UP_MARGIN * up:
            self.layout = layout


def write_latents(attn: Attention, latent: torch.Tensor, slots: torch.Tensor) -> None:
    """The step's latents [T, 1, D] into their cache slots, as the backend would have written them."""
    from tokenmill.layers.attention_backends import kv_quant  # here: the backends import the layers

    cache = attn.k_cache
    if kv_quant.is_quantized(cache.dtype):
        kv_quant.write_reference(attn, latent, latent, slots)  # V is K's tensor: the same values written twice
    else:
        cache.view(-1, cache.shape[-1]).index_copy_(0, slots, latent.reshape(-1, cache.shape[-1]).to(cache.dtype))


def read_context(attn: Attention, layout: BatchLayout, dtype: torch.dtype) -> torch.Tensor:
    """Every request's latents 0..kv_len-1 from the cache, [B, max_kv_len, D], zero past each request's end (so
    that unwritten slots, which may hold anything, meet the mask as zeros)."""
    from tokenmill.layers.attention_backends import kv_quant

    cache = attn.k_cache
    blocks = layout.block_table.to(cache.device, torch.long)
    B, NB = blocks.shape
    D, L = cache.shape[-1], layout.max_kv_len
    if kv_quant.is_quantized(cache.dtype):
        ctx = kv_quant.gather_dequantized(attn, blocks.flatten(), dtype)[0]
    else:
        ctx = cache.index_select(0, blocks.flatten()).to(dtype)
    ctx = ctx.view(B, NB * cache.shape[1], D)[:, :L]
    inside = torch.arange(L, device=cache.device) < layout.kv_len.to(cache.device).unsqueeze(1)
    return ctx.masked_fill(~inside.unsqueeze(-1), 0.0)


def up_projected_attention(attn: Attention, mla: MLASpec, q_nope: torch.Tensor, q_pe: torch.Tensor,
                           latent: torch.Tensor, w: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
    """q_nope [T, H, dn], q_pe [T, H, dr] (rotated), latent [T, 1, r + dr] (this step's), w [H, dn + v, r]
    (kv_b_proj, this rank's heads) -> [T, H, v]: causal multi-head attention with each request's keys and values
    up-projected from its cached latents."""
    T, H, dn = q_nope.shape
    r, dv = mla.kv_lora_rank, mla.v_head_dim
    device = q_nope.device
    write_latents(attn, latent, layout.slot_mapping.to(device, torch.long))
    ctx = read_context(attn, layout, q_nope.dtype)  # [B, L, r + dr]
    B, L, _ = ctx.shape
    kv = (ctx[..., :r] @ w.reshape(H * (dn + dv), r).t()).view(B, L, H, dn + dv)
    k = torch.cat([kv[..., :dn], ctx[..., r:].unsqueeze(2).expand(B, L, H, mla.qk_rope_head_dim)], dim=-1)
    v = kv[..., dn:]
    # The queries padded per request: row b holds request b's chunk (query_start .. + query_len).
    q_len = layout.query_len.to(device)
    j = torch.arange(layout.max_query_len, device=device)
    valid = j < q_len.unsqueeze(1)  # [B, Q]
    index = (layout.query_start.to(device).unsqueeze(1) + j).masked_fill(~valid, 0)
    q = torch.cat([q_nope, q_pe], dim=-1)[index]  # [B, Q, H, dn + dr]
    q_pos = layout.kv_len.to(device).unsqueeze(1) - q_len.unsqueeze(1) + j  # each query's position
    mask = torch.arange(L, device=device).view(1, 1, L) <= q_pos.unsqueeze(-1)  # causal; padded rows see key 0..
    o = _attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask.unsqueeze(1), q_pos, attn.scale)
    out = torch.empty(T, H, dv, dtype=o.dtype, device=device)
    out[index[valid]] = o.transpose(1, 2)[valid]
    return out


SCORES_BUDGET = 1 << 24  # score elements held at once (64 MiB in float32): queries are taken in blocks under it


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, q_pos: torch.Tensor,
            scale: float) -> torch.Tensor:
    """Masked softmax attention, q [B, H, Q, d], k [B, H, L, d], v [B, H, L, dv], mask [B, 1, Q, L] -> [B, H, Q, dv].
    On the CPU as two matmuls over blocks of queries, each against the keys up to its last position (causal: the
    later keys are all masked), measured faster than torch's SDPA for these shapes; elsewhere SDPA's kernels."""
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    B, H, Q, _ = q.shape
    step = max(1, SCORES_BUDGET // max(1, B * H * k.shape[2]))
    out = []
    for i in range(0, Q, step):
        end = int(q_pos[:, i:i + step].max()) + 1  # keys past every query of the block are masked for all
        s = torch.matmul(q[:, :, i:i + step], k[:, :, :end].transpose(-1, -2)).mul_(scale)
        s.masked_fill_(~mask[:, :, i:i + step, :end], float("-inf"))
        out.append(torch.matmul(torch.softmax(s, dim=-1), v[:, :, :end]))
    return torch.cat(out, dim=2) if len(out) > 1 else out[0]
