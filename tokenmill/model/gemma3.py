"""Gemma 3, text only (transformers' Gemma3ForCausalLM, config model_type "gemma3_text").

Differences from Llama: the embedding is scaled by sqrt(hidden_size); every RMSNorm scales by
(1 + weight); q and k are RMSNorm'd per head; each layer has a norm after attention and around
the MLP as well (four in all); the MLP is GELU-tanh gated; the attention scale comes from
query_pre_attn_scalar; and layers alternate between sliding-window attention with a local rope and
full attention with the global (possibly scaled) rope, as config.layer_types says.
Same packed-batch interface as LlamaForCausalLM.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tokenmill.layers.activation import act_fn, gated
from tokenmill.layers.attention import Attention
from tokenmill.layers.linear import Linear, MergedLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding, rope_inv_freq
from tokenmill.model.llama import LlamaForCausalLM

SLIDING, FULL = "sliding_attention", "full_attention"


def gemma_norm(dim: int, eps: float, dtype: torch.dtype) -> RMSNorm:
    """Gemma's RMSNorm: x * (1 + w) in float32; checkpoints store w (zero-centred), not 1 + w."""
    return RMSNorm(dim, eps, offset=1.0, dtype=dtype)


def layer_types(cfg) -> list[str]:
    types = getattr(cfg, "layer_types", None)
    if types is None:  # Gemma3TextConfig fills this in; default pattern is 5 sliding then 1 full
        types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(cfg.num_hidden_layers)]
    unknown = set(types) - {SLIDING, FULL}
    if unknown:
        raise ValueError(f"unsupported Gemma 3 layer types {sorted(unknown)}")
    return list(types)


class Gemma3Attention(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding, window: int | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = MergedLinear(cfg.hidden_size, [q_size, kv_size, kv_size], bias=bias, dtype=dtype)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=bias, dtype=dtype)
        self.q_norm = gemma_norm(self.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = gemma_norm(self.head_dim, cfg.rms_norm_eps, dtype)
        self.rotary = rotary
        scale = cfg.query_pre_attn_scalar**-0.5  # not head_dim**-0.5: they differ for Gemma 3 27B
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale, window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = self.q_norm(q.view(T, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(T, self.num_kv_heads, self.head_dim))
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta).reshape(T, -1))


class Gemma3MLP(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, dtype=dtype)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, dtype=dtype)
        self.act = act_fn(getattr(cfg, "hidden_activation", None) or "gelu_pytorch_tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated(self.gate_up_proj(x), self.act))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding, window: int | None, dtype: torch.dtype) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = gemma_norm(h, eps, dtype)
        self.self_attn = Gemma3Attention(cfg, rotary, window, dtype)
        self.post_attention_layernorm = gemma_norm(h, eps, dtype)
        self.pre_feedforward_layernorm = gemma_norm(h, eps, dtype)
        self.mlp = Gemma3MLP(cfg, dtype)
        self.post_feedforward_layernorm = gemma_norm(h, eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta) -> torch.Tensor:
        # Sandwich norms: each block's output is normalised before it joins the residual.
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype, compute_dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            raise NotImplementedError(
                f"attn_logit_softcapping={cfg.attn_logit_softcapping} is set in config.json, but tokenmill's "
                "attention backend has no logit soft-capping (Gemma 3 checkpoints leave it null)"
            )
        if getattr(cfg, "use_bidirectional_attention", False):
            raise NotImplementedError("use_bidirectional_attention=True (an encoder-style Gemma 3) is not supported")
        self.config = cfg
        self.compute_dtype = compute_dtype
        types = layer_types(cfg)
        # One cos/sin table per layer type: sliding layers use the local rope (theta 10k), full
        # layers the global one (theta 1M, plus e.g. linear scaling on the larger models).
        rotary = {}
        for t in sorted(set(types)):
            inv_freq, scaling = rope_inv_freq(cfg, cfg.head_dim, layer_type=t)
            rotary[t] = RotaryEmbedding(inv_freq, max_positions, scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        # transformers multiplies by sqrt(hidden_size) cast to the weights' dtype (55.4256 -> 55.5 in
        # bfloat16); rounding to the storage dtype matches it for a checkpoint loaded in that dtype.
        self.embed_scale = float(torch.tensor(cfg.hidden_size**0.5, dtype=dtype))
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, rotary[t], cfg.sliding_window if t == SLIDING else None, dtype) for t in types
        )
        self.norm = gemma_norm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype)
        self.final_logit_softcapping: float | None = getattr(cfg, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        x = self.embed_tokens(input_ids).to(self.compute_dtype) * self.embed_scale
        for layer in self.layers:
            x = layer(positions, x, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        logits = torch.nn.functional.linear(hidden, w.to(hidden.dtype)).float()
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    # Same tensor names as Llama (q/k/v and gate/up are merged the same way; the extra norms and
    # q/k norms load by name), so Llama's loader applies as is, including its missing-tensor error.
    _merged = LlamaForCausalLM._merged

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take (transformers name, tensor) pairs. Norm weights are transformers' zero-centred w
        (the model computes 1 + w), not llama.cpp's GGUF values, which have the 1 already added."""
        LlamaForCausalLM.load_weights(self, weights)
