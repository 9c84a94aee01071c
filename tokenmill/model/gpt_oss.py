"""gpt-oss (transformers' GptOssForCausalLM, OpenAI's open-weight MoE models).

The Llama decoder (pre-norm RMSNorms, residual stream) with:
- attention with q/k/v/o biases and per-head attention SINKS: a learned logit per head that joins each softmax's
  denominator and carries no value (Attention.sinks, in every attention backend that says `supports_sinks`);
- sliding-window and full layers alternating as `layer_types` says (the hybrid KV manager's cache groups);
- YaRN rope as the config gives it (transformers' initialiser, its attention factor on cos/sin);
- a MoE block: the router is a linear layer WITH bias; top-k of its logits, then a softmax over those k; every
  expert a clamped SwiGLU with biases: gate clamped above at `swiglu_limit`, up clamped to +-limit,
  out = (up + 1) * gate * sigmoid(alpha * gate), alpha = `swiglu_alpha`.

Checkpoint names: self_attn.{q,k,v,o}_proj.{weight,bias}, self_attn.sinks [H], mlp.router.{weight,bias},
mlp.experts.gate_up_proj [E, H, 2I] (gate and up INTERLEAVED along the last dim: column 2j is gate j, 2j+1 up j),
gate_up_proj_bias [E, 2I], down_proj [E, I, H], down_proj_bias [E, H]; or, with quantization_config mxfp4,
*_blocks / *_scales instead of the two expert weights (layers/quantization/mxfp4.py). Experts are held as
[gate rows of this rank; up rows of this rank] x H and H x this rank's I (F.linear layout), cut at load; under
tensor parallelism each rank holds a slice of every expert's intermediate dimension (the down bias is added on rank 0
only); under expert parallelism (--enable-expert-parallel) rank r holds whole experts [r E/N, (r+1) E/N) with their
biases, runs only the (token, expert) pairs routed to them, and adds its experts' down biases. Either way the router
(with its bias) is replicated and the block all-reduces once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import collectives
from tokenmill.layers.linear import ReplicatedLinear, check_shape
from tokenmill.layers.quantization.base import QuantizationConfig, set_weight_attrs
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.model.blocks import (AttentionBlock, AttentionSpec, Build, DecoderForCausalLM, DecoderSpec, LayerSpec,
                                    MLPSpec)
from tokenmill.model.hf_config import hf_get
from tokenmill.model.registry import register_model
from tokenmill.model.weights import WeightNaming

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class ExpertsSpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    alpha: float  # swiglu_alpha
    limit: float  # swiglu_limit
    gguf_mxfp4: bool = False  # a GGUF file's experts are MXFP4: kept so where its blocks are kept (gguf_gpt_oss.py)


@dataclass(frozen=True)
class GptOssSpec(DecoderSpec):
    experts: ExpertsSpec | None = None


@dataclass(frozen=True)
class GptOssNaming(WeightNaming):
    def param_name(self, name: str, tied: bool) -> str | None:
        name = super().param_name(name, tied)
        if name is not None and name.endswith(".self_attn.sinks"):  # the Attention layer holds them
            return name[: -len("sinks")] + "attn.sinks"
        return name


def gpt_oss_spec(cfg) -> GptOssSpec:
    types = list(hf_get(cfg, "layer_types") or [SLIDING if i % 2 == 0 else FULL
                                                 for i in range(cfg.num_hidden_layers)])
    unknown = set(types) - {SLIDING, FULL}
    if unknown:
        raise ValueError(f"unsupported gpt-oss layer types {sorted(unknown)}")
    bias = bool(hf_get(cfg, "attention_bias", True))
    head_dim = hf_get(cfg, "head_dim") or cfg.hidden_size // cfg.num_attention_heads
    return GptOssSpec(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        rms_norm_eps=cfg.rms_norm_eps,
        attention=AttentionSpec(cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, head_dim**-0.5,
                                qkv_bias=bias, o_bias=bias, sinks=True),
        mlp=MLPSpec(cfg.intermediate_size),  # unused: every layer has the MoE block
        layers=tuple(LayerSpec(cfg.sliding_window if t == SLIDING else None) for t in types),
        tie_word_embeddings=bool(hf_get(cfg, "tie_word_embeddings", False)),
        experts=ExpertsSpec(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size,
                            float(hf_get(cfg, "swiglu_alpha", 1.702)), float(hf_get(cfg, "swiglu_limit", 7.0)),
                            hf_get(cfg, "gguf_expert_type") == "MXFP4"),
    )


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[N, 2s] (this rank's gate columns, then its up columns) -> [N, s]."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class FloatExperts:
    """Float expert weights: gate_up_proj [E, 2s, H] and down_proj [E, H, s] (F.linear layout)."""

    def create_weights(self, layer: "GptOssExperts", dtype: torch.dtype) -> None:
        E, H, s = layer.num_local, layer.hidden_size, layer.shard
        layer.gate_up_proj = _param(torch.empty(E, 2 * s, H, dtype=dtype), layer.load_gate_up)
        layer.down_proj = _param(torch.empty(E, H, s, dtype=dtype), layer.load_down)

    def linear(self, layer: "GptOssExperts", name: str, e: int, x: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        """x [n, cols] @ expert e's weight ("gate_up" or "down")^T (+ bias)."""
        w = (layer.gate_up_proj if name == "gate_up" else layer.down_proj)[e]
        return F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype), bias)


def _param(t: torch.Tensor, loader) -> nn.Parameter:
    p = nn.Parameter(t, requires_grad=False)
    set_weight_attrs(p, {"weight_loader": loader})
    return p


def experts_method(quant_config: QuantizationConfig | None, spec: ExpertsSpec):
    if quant_config is None:
        return FloatExperts()
    if quant_config.name == "gguf" and not spec.gguf_mxfp4:  # a GGUF file's experts are dequantized at load
        return FloatExperts()
    if quant_config.name in ("mxfp4", "gguf"):
        from tokenmill.layers.quantization.mxfp4 import Mxfp4Experts

        return Mxfp4Experts()
    # Refused at load, named: the expert kernels read float or MXFP4 weights only.
    raise ValueError(f"gpt-oss experts with {quant_config.name!r} quantization are not supported "
                     "(float or the checkpoint's mxfp4)")


class GptOssExperts(nn.Module):
    """All experts of one layer; forward(x [T, H], weights [T, k], ids [T, k]) -> this rank's partial [T, H]."""

    def __init__(self, spec: ExpertsSpec, hidden_size: int, build: Build) -> None:
        super().__init__()
        # Expert parallel: whole experts per rank (tensor-parallel size 1 inside them); else a slice of every expert.
        ep = build.expert_parallel and build.tp_size > 1
        ep_size, tp_size = (build.tp_size, 1) if ep else (1, build.tp_size)
        if spec.num_experts % ep_size:
            raise ValueError(f"{spec.num_experts} experts do not divide over expert-parallel size {ep_size}")
        if spec.intermediate_size % tp_size:
            raise ValueError(f"expert intermediate size {spec.intermediate_size} does not divide over "
                             f"tensor-parallel size {tp_size}")
        self.num_experts, self.hidden_size = spec.num_experts, hidden_size
        self.num_local = spec.num_experts // ep_size
        self.first = (build.tp_rank if ep else 0) * self.num_local  # this rank's first expert
        self.intermediate_size, self.shard = spec.intermediate_size, spec.intermediate_size // tp_size
        self.tp_rank = 0 if ep else build.tp_rank
        self.ep = ep
        self.alpha, self.limit = spec.alpha, spec.limit
        E, s = self.num_local, self.shard
        self.method = experts_method(build.quant_config, spec)
        self.method.create_weights(self, build.params_dtype)
        self.gate_up_proj_bias = _param(torch.zeros(E, 2 * s, dtype=build.params_dtype), self.load_gate_up_bias)
        self.down_proj_bias = _param(torch.zeros(E, hidden_size, dtype=build.params_dtype), self.load_down_bias)

    # The loaders take the checkpoint's tensors (float: [E, in, out]; the method's own forms call the row helpers).
    def local_experts(self, t: torch.Tensor) -> torch.Tensor:
        """[E, ...] -> this rank's experts [E_local, ...] (all of them without expert parallelism)."""
        return t.narrow(0, self.first, self.num_local)

    def gate_up_rows(self, t: torch.Tensor) -> torch.Tensor:
        """[E, 2I, ...] with gate/up interleaved rows -> [E_local, 2s, ...]: this rank's gate rows, then its up
        rows."""
        lo, s = self.tp_rank * self.shard, self.shard
        t = self.local_experts(t)
        return torch.cat([t[:, 0::2][:, lo:lo + s], t[:, 1::2][:, lo:lo + s]], dim=1)

    def load_gate_up(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        check_shape(loaded, (self.num_experts, self.hidden_size, 2 * self.intermediate_size))
        param.data.copy_(self.gate_up_rows(loaded.transpose(1, 2)))

    def load_gate_up_bias(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        check_shape(loaded, (self.num_experts, 2 * self.intermediate_size))
        param.data.copy_(self.gate_up_rows(loaded))

    def load_down(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        check_shape(loaded, (self.num_experts, self.intermediate_size, self.hidden_size))
        param.data.copy_(self.local_experts(loaded).transpose(1, 2).narrow(2, self.tp_rank * self.shard, self.shard))

    def load_down_bias(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        check_shape(loaded, (self.num_experts, self.hidden_size))
        param.data.copy_(self.local_experts(loaded))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        T, k = ids.shape
        E = self.num_local
        flat = ids.reshape(-1) - self.first  # local expert ids; other ranks' experts are out of [0, E)
        if self.ep:
            flat = torch.where((flat >= 0) & (flat < E), flat, E)  # sorted past the end and never run
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E + 1).tolist()[:E]
        order = order[:sum(counts)]  # the pairs this rank runs
        tokens = order // k
        xs = x.index_select(0, tokens)
        ws = weights.reshape(-1).index_select(0, order).to(x.dtype).unsqueeze(1)
        ys = torch.empty_like(xs)
        # The partial sums are all-reduced: the down bias is added once, by the rank holding the expert (under
        # expert parallelism, each rank for its own experts; else rank 0).
        down_bias = self.ep or self.tp_rank == 0
        start = 0
        for e, n in enumerate(counts):  # over experts, never over tokens
            if n == 0:
                continue
            end = start + n
            gate_up = self.method.linear(self, "gate_up", e, xs[start:end], self.gate_up_proj_bias[e].to(x.dtype))
            h = clamped_swiglu(gate_up, self.alpha, self.limit)
            y = self.method.linear(self, "down", e, h, self.down_proj_bias[e].to(x.dtype) if down_bias else None)
            torch.mul(y, ws[start:end], out=ys[start:end])
            start = end
        return torch.zeros_like(x).index_add_(0, tokens, ys)


class GptOssMoE(nn.Module):
    def __init__(self, hidden_size: int, spec: ExpertsSpec, build: Build, prefix: str) -> None:
        super().__init__()
        self.top_k, self.tp_size = spec.top_k, build.tp_size
        self.router = ReplicatedLinear(hidden_size, spec.num_experts, True, params_dtype=build.params_dtype,
                                       compute_dtype=build.compute_dtype, prefix=f"{prefix}.router")
        self.experts = GptOssExperts(spec, hidden_size, build)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)  # top-k logits, then a softmax over those k
        out = self.experts(x, top.softmax(-1), ids)
        if self.tp_size > 1:
            collectives.all_reduce(out)
        return out


class GptOssDecoderLayer(nn.Module):
    """Pre-norm layer: attention with sinks (sliding or full), then the MoE block (DecoderLayer's contract)."""

    def __init__(self, spec: GptOssSpec, layer: LayerSpec, rotary: RotaryEmbedding, build: Build,
                 prefix: str) -> None:
        super().__init__()
        h = spec.hidden_size
        self.input_layernorm = build.norm(h, spec)
        self.self_attn = AttentionBlock(spec, rotary, layer.sliding_window, build, f"{prefix}.self_attn")
        self.post_attention_layernorm = build.norm(h, spec)
        self.mlp = GptOssMoE(h, spec.experts, build, f"{prefix}.mlp")

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            residual, x = self.input_layernorm.add(residual, x)
        residual, x = self.post_attention_layernorm.add(residual, self.self_attn(positions, x, meta))
        return self.mlp(x), residual


@register_model("GptOssForCausalLM")
class GptOssForCausalLM(DecoderForCausalLM):
    packed_modules_mapping: dict[str, list[str]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    weight_naming = GptOssNaming()
    decoder_layer = GptOssDecoderLayer

    def __init__(self, cfg, dtype: torch.dtype, compute_dtype: torch.dtype, max_positions: int,
                 quant_config: QuantizationConfig | None = None, tp_rank: int = 0, tp_size: int = 1,
                 expert_parallel: bool = False, pp_rank: int = 0, pp_size: int = 1) -> None:
        super().__init__(cfg, gpt_oss_spec(cfg), dtype, compute_dtype, max_positions, quant_config, tp_rank,
                         tp_size, expert_parallel, pp_rank, pp_size)
