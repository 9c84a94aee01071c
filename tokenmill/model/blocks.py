"""Decoder blocks shared by the model families: attention (packed qkv projection, optional q/k RMSNorm,
rotary, paged attention, output projection), the gated MLP, the decoder layer (pre-norm, Gemma's
sandwich norms or OLMo 2's post-norms; Granite's residual multiplier) and the decoder-only stack with its embedding and LM head.

A family file turns its Hugging Face config into a DecoderSpec in one function; nothing here reads
model_type. Input is a packed batch: token ids [T] and positions [T] of every request's new tokens,
with the attention metadata that says which request each token belongs to. No padding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from tokenmill.layers import collectives
from tokenmill.layers.activation import act_fn, gated
from tokenmill.layers.attention import Attention
from tokenmill.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                                    check_shape)
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.quantization.base import QuantizationConfig, set_weight_attrs
from tokenmill.layers.rotary import RotaryEmbedding, rope_inv_freq
from tokenmill.model.moe_block import MoEBlock, MoESpec
from tokenmill.model import native_stack
from tokenmill.model.native_stack import NativeStack
from tokenmill.model.weights import WeightNaming, load_weights


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # softmax scale
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary
    qk_norm_all_heads: bool = False  # with qk_norm, OLMo 2's: one RMSNorm over the whole q (k) projection
    logits_soft_cap: float | None = None  # Gemma 2: cap * tanh(scores / cap) before the softmax
    rotary_dim: int | None = None  # partial rotary: rotate only the first rotary_dim features; None: head_dim
    rotary_interleaved: bool = False  # GLM: rotate feature pairs (2i, 2i+1), not (i, i + rotary_dim/2)
    sinks: bool = False  # gpt-oss: a learned logit per head in each softmax's denominator (Attention.sinks)


@dataclass(frozen=True)
class MLPSpec:
    intermediate_size: int
    activation: str = "silu"
    bias: bool = False


@dataclass(frozen=True)
class LayerSpec:
    sliding_window: int | None = None  # None: full attention
    rope: str | None = None  # key of this layer's rope parameters (transformers' layer_type); None: the only ones
    dense_mlp: bool = False  # in a MoE model: this layer has the dense MLP (Qwen2-MoE's mlp_only_layers)


@dataclass(frozen=True)
class DecoderSpec:
    vocab_size: int
    hidden_size: int
    rms_norm_eps: float
    attention: AttentionSpec
    mlp: MLPSpec
    layers: tuple[LayerSpec, ...]
    norm_offset: float = 0.0  # 1.0: Gemma's RMSNorm, x * (1 + w)
    sandwich_norms: bool = False  # Gemma: also norm each block's output, and a separate pre-MLP norm
    post_norms: bool = False  # OLMo 2: norm only each block's output (post_attention/post_feedforward), no input norms
    embed_scale: float | None = None  # multiply the embeddings by this
    tie_word_embeddings: bool = False
    final_logit_softcapping: float | None = None
    residual_multiplier: float | None = None  # Granite: each block's output is scaled by this before the residual add
    logits_scaling: float | None = None  # Granite: the logits are divided by this
    moe: MoESpec | None = None  # set: layers without dense_mlp have a mixture-of-experts block


@dataclass(frozen=True)
class Build:
    """How to build the layers: storage/compute dtypes, quantization and this rank's shard."""

    params_dtype: torch.dtype
    compute_dtype: torch.dtype
    quant_config: QuantizationConfig | None = None
    tp_rank: int = 0
    tp_size: int = 1
    expert_parallel: bool = False  # MoE layers: whole experts per rank instead of a slice of every expert

    def linear(self, prefix: str) -> dict:
        return dict(tp_rank=self.tp_rank, tp_size=self.tp_size, params_dtype=self.params_dtype,
                    compute_dtype=self.compute_dtype, quant_config=self.quant_config, prefix=prefix)

    def norm(self, dim: int, spec: DecoderSpec) -> RMSNorm:
        return RMSNorm(dim, spec.rms_norm_eps, offset=spec.norm_offset, dtype=self.params_dtype)


class ShardedHeadsRMSNorm(nn.Module):
    """RMSNorm over a whole q or k projection that tensor parallelism splits by heads (OLMo 2): this rank holds its
    heads' slice of the weight, and the sum of squares is all-reduced; where each KV head is on `replicas` ranks,
    the sum counted it that many times."""

    def __init__(self, total: int, local: int, shard: int, replicas: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.total, self.local, self.shard, self.replicas, self.eps = total, local, shard, replicas, eps
        self.weight = nn.Parameter(torch.ones(local, dtype=dtype), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if loaded_weight.shape != (self.total,):
            raise ValueError(f"has shape {tuple(loaded_weight.shape)}, expected ({self.total},)")
        param.data.copy_(loaded_weight[self.shard * self.local:(self.shard + 1) * self.local])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        squares = collectives.all_reduce(xf.pow(2).sum(-1, keepdim=True))
        inv = torch.rsqrt(squares / (self.replicas * self.total) + self.eps)
        return (xf * inv * self.weight.float()).to(x.dtype)


class AttentionBlock(nn.Module):
    def __init__(self, spec: DecoderSpec, rotary: RotaryEmbedding, window: int | None, build: Build,
                 prefix: str) -> None:
        super().__init__()
        a = spec.attention
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, a.head_dim, a.num_heads, a.num_kv_heads, a.qkv_bias,
                                          **build.linear(f"{prefix}.qkv_proj"))
        self.o_proj = RowParallelLinear(a.num_heads * a.head_dim, spec.hidden_size, a.o_bias,
                                        **build.linear(f"{prefix}.o_proj"))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.head_dim = a.head_dim
        self.sizes = [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size]
        self.qk_norm = a.qk_norm
        self.qk_norm_all_heads = a.qk_norm and a.qk_norm_all_heads
        if self.qk_norm_all_heads and build.tp_size == 1:
            self.q_norm = build.norm(a.num_heads * a.head_dim, spec)
            self.k_norm = build.norm(a.num_kv_heads * a.head_dim, spec)
        elif self.qk_norm_all_heads:  # each rank norms its heads with the squares of all
            if spec.norm_offset:
                raise ValueError("q/k norms over all heads with a norm offset are not supported under tensor parallelism")
            qkv, eps = self.qkv_proj, spec.rms_norm_eps
            replicas = qkv.num_kv_head_replicas
            self.q_norm = ShardedHeadsRMSNorm(a.num_heads * a.head_dim, qkv.q_size, build.tp_rank, 1, eps,
                                              build.params_dtype)
            self.k_norm = ShardedHeadsRMSNorm(a.num_kv_heads * a.head_dim, qkv.kv_size, build.tp_rank // replicas,
                                              replicas, eps, build.params_dtype)
        elif a.qk_norm:
            self.q_norm = build.norm(a.head_dim, spec)
            self.k_norm = build.norm(a.head_dim, spec)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, a.head_dim, a.scale, window, a.logits_soft_cap,
                              a.sinks)
        if a.sinks:  # this rank's heads of the checkpoint's [num_heads] sinks
            first, total = build.tp_rank * self.num_heads, a.num_heads

            def load_sinks(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
                check_shape(loaded, (total,))
                param.data.copy_(loaded.narrow(0, first, param.numel()))

            set_weight_attrs(self.attn.sinks, {"weight_loader": load_sinks})

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        if self.qk_norm_all_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm and not self.qk_norm_all_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        o = self.attn(q, k, v, meta)
        return self.o_proj(o.reshape(T, -1))


class MLPBlock(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up in one GEMM."""

    def __init__(self, spec: DecoderSpec, build: Build, prefix: str) -> None:
        super().__init__()
        m = spec.mlp
        self.gate_up_proj = MergedColumnParallelLinear(spec.hidden_size, [m.intermediate_size] * 2, m.bias,
                                                       **build.linear(f"{prefix}.gate_up_proj"))
        self.down_proj = RowParallelLinear(m.intermediate_size, spec.hidden_size, m.bias,
                                           **build.linear(f"{prefix}.down_proj"))
        self.act_name = m.activation
        self.act = act_fn(m.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated(self.gate_up_proj(x), self.act, self.act_name))


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, layer: LayerSpec, rotary: RotaryEmbedding, build: Build,
                 prefix: str) -> None:
        super().__init__()
        h = spec.hidden_size
        if spec.sandwich_norms and spec.post_norms:
            raise ValueError("sandwich_norms and post_norms are exclusive")
        self.post_norms = spec.post_norms
        if not self.post_norms:
            self.input_layernorm = build.norm(h, spec)
        self.self_attn = AttentionBlock(spec, rotary, layer.sliding_window, build, f"{prefix}.self_attn")
        # Pre-norm: post_attention_layernorm is the MLP's input norm. Sandwich: it norms the attention
        # output, and two more norms wrap the MLP. Post-norms: it norms the attention output, and
        # post_feedforward_layernorm the MLP's.
        self.post_attention_layernorm = build.norm(h, spec)
        self.sandwich = spec.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = build.norm(h, spec)
        if self.sandwich or self.post_norms:
            self.post_feedforward_layernorm = build.norm(h, spec)
        self.residual_multiplier = spec.residual_multiplier
        if spec.moe is not None and not layer.dense_mlp:
            self.mlp = MoEBlock(h, spec.moe, build, f"{prefix}.mlp")
        else:
            self.mlp = MLPBlock(spec, build, f"{prefix}.mlp")

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (block output, residual stream): the caller adds them, fused with the next norm (the
        first layer gets residual=None and x the embeddings)."""
        if self.post_norms:
            return self._forward_post_norms(positions, x, meta, residual)
        if self.residual_multiplier is not None:
            return self._forward_scaled(positions, x, meta, residual)
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            residual, x = self.input_layernorm.add(residual, x)
        if self.sandwich:
            x = self.post_attention_layernorm(self.self_attn(positions, x, meta))
            residual, x = self.pre_feedforward_layernorm.add(residual, x)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        residual, x = self.post_attention_layernorm.add(residual, self.self_attn(positions, x, meta))
        return self.mlp(x), residual

    def _forward_post_norms(self, positions: torch.Tensor, x: torch.Tensor, meta,
                            residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # OLMo 2: the stream itself (not a norm of it) enters each block; the block's output is normed.
        stream = x if residual is None else residual + x
        stream = stream + self.post_attention_layernorm(self.self_attn(positions, stream, meta))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream

    def _forward_scaled(self, positions: torch.Tensor, x: torch.Tensor, meta,
                        residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # Granite: pre-norm, each block's output times residual_multiplier before it joins the stream.
        m = self.residual_multiplier
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            residual, x = self.input_layernorm.add(residual, x)
        residual, x = self.post_attention_layernorm.add(residual, self.self_attn(positions, x, meta) * m)
        return self.mlp(x) * m, residual


class DecoderForCausalLM(nn.Module):
    """Embedding -> decoder layers -> final norm; `compute_logits` on the rows to sample.

    `storage_dtype` is the dtype float weights are stored in (the KV cache's dtype under "auto");
    `compute_dtype` the one activations are computed in."""

    packed_modules_mapping: dict[str, list[str]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    weight_naming = WeightNaming()
    # The layer class built for each decoder layer (a family with its own attention, e.g. DeepSeek's MLA, names
    # its own; same constructor arguments and forward contract).
    decoder_layer: type[nn.Module] = DecoderLayer
    # Opt-in (EAGLE-3): forward also stores in `aux_hidden_states` the residual stream after each of these
    # layers (-1: the embeddings), concatenated on the last dim. Empty: nothing extra is done.
    aux_hidden_layers: tuple[int, ...] = ()
    aux_hidden_states: torch.Tensor | None = None
    # Set when decoder layers stream their weights (model/weight_store.py's WeightStore from disk,
    # model/host_offload.py's HostOffload from host memory): `.streamed`, `.describe()`.
    weight_store = None

    def __init__(self, cfg, spec: DecoderSpec, dtype: torch.dtype, compute_dtype: torch.dtype, max_positions: int,
                 quant_config: QuantizationConfig | None = None, tp_rank: int = 0, tp_size: int = 1,
                 expert_parallel: bool = False, pp_rank: int = 0, pp_size: int = 1) -> None:
        super().__init__()
        self.config = cfg
        self.spec = spec
        self.storage_dtype = dtype
        self.compute_dtype = compute_dtype
        self.quant_config = quant_config
        self.tie_word_embeddings = spec.tie_word_embeddings
        self.embed_scale = spec.embed_scale
        self.final_logit_softcapping = spec.final_logit_softcapping
        self.logits_scaling = spec.logits_scaling
        build = Build(dtype, compute_dtype, quant_config, tp_rank, tp_size, expert_parallel)
        rotary = {}
        for key in {layer.rope for layer in spec.layers}:
            inv_freq, scaling = rope_inv_freq(cfg, spec.attention.rotary_dim or spec.attention.head_dim, layer_type=key)
            rotary[key] = RotaryEmbedding(inv_freq, max_positions, scaling, spec.attention.rotary_interleaved)
        # Pipeline parallelism: this stage holds layers [start, end); the first stage the embedding, the last
        # the final norm and LM head (and the embedding too when the head is tied to it). Layers of other
        # stages are empty placeholders, so parameter names keep their global layer index.
        L = len(spec.layers)
        if not 1 <= pp_size <= L:
            raise ValueError(f"pipeline_parallel_size {pp_size} must be between 1 and the {L} layers")
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.start, self.end = L * pp_rank // pp_size, L * (pp_rank + 1) // pp_size
        self.is_first, self.is_last = pp_rank == 0, pp_rank == pp_size - 1
        # First parameter: code that asks for the storage dtype with next(model.parameters()) gets it.
        self.embed_tokens = None
        if self.is_first or (self.is_last and spec.tie_word_embeddings):
            self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, dtype, tp_rank, tp_size)
        self.layers = nn.ModuleList(
            self.decoder_layer(spec, layer, rotary[layer.rope], build, f"layers.{i}") if self.start <= i < self.end
            else nn.Identity() for i, layer in enumerate(spec.layers)
        )
        self.own_layers = list(self.layers)[self.start : self.end]  # a plain list: no ModuleList slice per step
        self._stack: NativeStack | None | bool = False  # False: not built yet (model/native_stack.py)
        self.lora_step = None  # layers/lora.LoRAStep with --enable-lora: a step with adapter tokens runs in Python
        self.norm = self.lm_head = None
        if self.is_last:
            self.norm = build.norm(spec.hidden_size, spec)
            self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, dtype, tp_rank, tp_size)
            if spec.tie_word_embeddings:
                self.lm_head.tie_weights(self.embed_tokens)

    def begin_step(self, layout) -> None:
        """The runner's batch layout (attention_backends/base.BatchLayout) before a forward, None after it (and
        for forwards whose layout it cannot hand over). DeepSeek's MLA picks its attention form from it."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """The final normed hidden states; a pipeline stage before the last returns (x, residual) for the
        next stage, which passes them as `intermediate`."""
        if self.is_first:
            x, residual = self.embed_tokens(input_ids).to(self.compute_dtype), None
            if self.embed_scale is not None:
                x = x * self.embed_scale
        else:
            x, residual = intermediate
        if self.aux_hidden_layers:
            return self._forward_capturing(positions, x, meta)
        stack = self._native_stack()
        if stack is not None and not (self.lora_step is not None and self.lora_step.active) and stack.ready(meta):
            x, residual = stack.forward(positions, x, meta, residual)
        else:
            for layer in self.own_layers:
                x, residual = layer(positions, x, meta, residual)
        if not self.is_last:
            return x, residual
        return self.norm.add(residual, x)[1]

    def _native_stack(self) -> NativeStack | None:
        """The layers as one native call (model/native_stack.py), built at the first forward (the weights are
        loaded and packed by then); None where the model does not qualify."""
        if self._stack is False:
            self._stack = NativeStack.build(self)
        return self._stack if native_stack.switched_on() else None

    def _forward_capturing(self, positions: torch.Tensor, x: torch.Tensor, meta) -> torch.Tensor:
        wanted = self.aux_hidden_layers
        states = {-1: x} if -1 in wanted else {}
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(positions, x, meta, residual)
            if i in wanted:
                states[i] = x + residual
        self.aux_hidden_states = torch.cat([states[i] for i in wanted], dim=-1)
        return self.norm.add(residual, x)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 [N, vocab]."""
        logits = self.lm_head.compute_logits(hidden)
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take (transformers name, full tensor) pairs; fail naming any tensor that is missing."""
        load_weights(self, weights)
