"""Multi-head Latent Attention (DeepSeek-V2/V3) over a compressed latent KV cache.

Each token's keys and values are one latent: c_kv (kv_lora_rank features, after kv_a_layernorm) and k_pe
(qk_rope_head_dim features, rotated), shared by every head. kv_b_proj up-projects c_kv, per head h, into
k_nope_h = W_UK_h c_kv and v_h = W_UV_h c_kv. The cache stores only the latent, [c_kv, k_pe], as one "KV head"
of width kv_lora_rank + qk_rope_head_dim (576 for V3), paged like every other cache.

Attention is computed in the absorbed form for decodes (and for any step where it is cheaper): a head's score
q_nope_h . k_nope_h + q_pe_h . k_pe = (W_UK_h^T q_nope_h) . c_kv + q_pe_h . k_pe, so the query multiplied into
the latent space, [W_UK_h^T q_nope_h, q_pe_h], attends over the cached latents as multi-query attention with one
KV head; the weighted sum of the latents' c_kv part, times W_UV_h, is the head's output. V is therefore the first
kv_lora_rank features of K: the layer is an `Attention` with `kv_shared` (its v_cache is its k_cache), so every
attention backend runs it unchanged, nothing is stored twice, and the pool is sized by the latent width alone.
The score is the reference's up to float rounding (the same products summed in another order). Steps of long
prompt chunks run the up-projected form instead (layers/mla_up.py: the rule, its FLOP counts and the switch).

Under tensor parallelism each rank holds its heads' rows of q_proj / q_b_proj / kv_b_proj and o_proj's
columns; the latent projection (kv_a_proj_with_mqa, q_a_proj) is replicated, so every rank caches the whole
latent (tested at TP=1 only).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.layers.attention import Attention
from tokenmill.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, check_shape
from tokenmill.layers.mla_up import MLAStep, up_projected_attention
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.quantization.base import set_weight_attrs
from tokenmill.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from tokenmill.model.blocks import Build

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers builds them with the default eps


@dataclass(frozen=True)
class MLASpec:
    q_lora_rank: int | None  # None (V2-Lite): q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    bias: bool = False  # attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj

    @property
    def latent_dim(self) -> int:
        """Cached features per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim


class LatentAttention(Attention):
    """One KV head of the latent width whose V is its K (the backend writes the same latent into both names)."""

    kv_shared = True


class HeadRowsWeight(nn.Module):
    """kv_b_proj kept as a plain weight [heads * (qk_nope + v), kv_lora_rank], this rank's heads' rows: the
    absorbed form multiplies queries and outputs by its per-head blocks, never runs it as a linear layer
    (so no quantization packs it). A block-scaled FP8 checkpoint (`fp8_block`: DeepSeek-V3's) stores it as FP8
    with `weight_scale_inv`: dequantized to this weight once both are in."""

    def __init__(self, rows_per_head: int, num_heads: int, cols: int, tp_rank: int, tp_size: int,
                 dtype: torch.dtype, fp8_block: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.full = (rows_per_head * num_heads, cols)
        self.local = rows_per_head * (num_heads // tp_size)
        self.tp_rank = tp_rank
        self.weight = nn.Parameter(torch.empty(self.local, cols, dtype=dtype), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})
        self.fp8_block = fp8_block
        self._fp8: torch.Tensor | None = None  # the FP8 weight, until its scales are in
        if fp8_block is not None:
            bn, bk = fp8_block
            blocks = (-(-self.full[0] // bn), -(-cols // bk))
            self.weight_scale_inv = nn.Parameter(torch.full(blocks, float("nan")), requires_grad=False)
            set_weight_attrs(self.weight_scale_inv, {"weight_loader": self.scale_loader})

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        check_shape(loaded, self.full)
        if loaded.dtype == torch.float8_e4m3fn:
            if self.fp8_block is None:
                raise ValueError("is float8 without block scales: only a block-scaled fp8 checkpoint "
                                 "(weight_block_size) can be loaded into MLA's kv_b_proj")
            self._fp8 = loaded
            self._dequantize()
            return
        param.data.copy_(loaded.narrow(0, self.tp_rank * self.local, self.local))

    def scale_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        from tokenmill.layers.quantization.fp8_block import expand_rows

        expand_rows(loaded, *self.full, self.fp8_block)  # checks its shape and values
        param.data.copy_(loaded)
        self._dequantize()

    def _dequantize(self) -> None:
        from tokenmill.layers.quantization.fp8_block import dequantize_block_fp8, expand_rows

        if self._fp8 is None or torch.isnan(self.weight_scale_inv).any():
            return  # the other half is not in yet
        scale = expand_rows(self.weight_scale_inv.data, *self.full, self.fp8_block)
        w = dequantize_block_fp8(self._fp8, scale, self.fp8_block[1])
        self.weight.data.copy_(w.narrow(0, self.tp_rank * self.local, self.local))
        self._fp8 = None


def _fp8_block(build: "Build") -> tuple[int, int] | None:
    """The block size of a block-scaled FP8 checkpoint, else None."""
    if build.quant_config is None or build.quant_config.name != "fp8":
        return None
    from tokenmill.layers.quantization.fp8_block import Fp8BlockConfig

    return build.quant_config.block if isinstance(build.quant_config, Fp8BlockConfig) else None


class MLAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, mla: MLASpec, scale: float, rotary: RotaryEmbedding,
                 build: "Build", prefix: str) -> None:
        super().__init__()
        if num_heads % build.tp_size:
            raise ValueError(f"{num_heads} attention heads do not divide over tensor-parallel size {build.tp_size}")
        self.mla = mla
        self.num_heads = num_heads // build.tp_size  # this rank's
        qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden_size, num_heads * qk_head_dim, False,
                                               **build.linear(f"{prefix}.q_proj"))
        else:
            self.q_a_proj = ReplicatedLinear(hidden_size, mla.q_lora_rank, mla.bias,
                                             **build.linear(f"{prefix}.q_a_proj"))
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, dtype=build.params_dtype)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, num_heads * qk_head_dim, False,
                                                 **build.linear(f"{prefix}.q_b_proj"))
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden_size, mla.latent_dim, mla.bias,
                                                   **build.linear(f"{prefix}.kv_a_proj_with_mqa"))
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS, dtype=build.params_dtype)
        self.kv_b_proj = HeadRowsWeight(mla.qk_nope_head_dim + mla.v_head_dim, num_heads, mla.kv_lora_rank,
                                        build.tp_rank, build.tp_size, build.params_dtype, _fp8_block(build))
        self.o_proj = RowParallelLinear(num_heads * mla.v_head_dim, hidden_size, mla.bias,
                                        **build.linear(f"{prefix}.o_proj"))
        self.rotary = rotary
        self.attn = LatentAttention(self.num_heads, 1, mla.latent_dim, scale)
        # The model's per-step choice of form (set by DeepseekV2ForCausalLM; None, as in an MTP head: absorbed).
        self.step: MLAStep | None = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta) -> torch.Tensor:
        m, H, T = self.mla, self.num_heads, x.shape[0]
        dn, dr, r = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(T, H, dn + dr).split([dn, dr], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([r, dr], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())
        q_pe, k_pe = self.rotary(positions, q_pe.contiguous(), k_pe.reshape(T, 1, dr).contiguous())
        w = self.kv_b_proj.weight.view(H, dn + m.v_head_dim, r)
        if w.dtype != x.dtype:
            w = w.to(x.dtype)
        latent = torch.cat([c_kv.unsqueeze(1), k_pe], dim=-1)  # [T, 1, r + dr]: what the cache stores
        if self.step is not None and self.step.layout is not None:
            o = up_projected_attention(self.attn, m, q_nope, q_pe, latent, w, self.step.layout)
            return self.o_proj(o.reshape(T, H * m.v_head_dim))
        q_latent = torch.bmm(q_nope.transpose(0, 1), w[:, :dn]).transpose(0, 1)  # [T, H, r]: W_UK_h^T q_nope_h
        query = torch.cat([q_latent, q_pe], dim=-1)  # [T, H, r + dr]
        o = self.attn(query, latent, latent, meta)[..., :r]  # the weighted sum of the cached c_kv
        o = torch.bmm(o.transpose(0, 1), w[:, dn:].transpose(1, 2)).transpose(0, 1)  # [T, H, v]: W_UV_h
        return self.o_proj(o.reshape(T, H * m.v_head_dim))
