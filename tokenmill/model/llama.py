"""The Llama family: Llama 2/3, Mistral (sliding window), Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm).

Input is a packed batch: token ids [T] and positions [T] of every request's new tokens, with the
attention metadata that says which request each token belongs to. No padding.
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


def layer_windows(cfg) -> list[int | None]:
    """Sliding window of each layer (None: full attention), as transformers decides it."""
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    return [window] * n


class LlamaAttention(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding, window: int | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv_bias = getattr(cfg, "attention_bias", False) or cfg.model_type == "qwen2"
        o_bias = getattr(cfg, "attention_bias", False) and cfg.model_type != "qwen2"
        self.qkv_proj = MergedLinear(cfg.hidden_size, [q_size, kv_size, kv_size], bias=qkv_bias, dtype=dtype)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=o_bias, dtype=dtype)
        self.qk_norm = cfg.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype=dtype)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        o = self.attn(q, k, v, meta)
        return self.o_proj(o.reshape(T, -1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype) -> None:
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=bias, dtype=dtype)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias, dtype=dtype)
        self.act = act_fn(getattr(cfg, "hidden_act", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated(self.gate_up_proj(x), self.act))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding, window: int | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = LlamaAttention(cfg, rotary, window, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = LlamaMLP(cfg, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype, compute_dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.compute_dtype = compute_dtype
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        inv_freq, scaling = rope_inv_freq(cfg, head_dim)
        rotary = RotaryEmbedding(inv_freq, max_positions, scaling)
        # _weight skips the random init: the checkpoint overwrites it.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype))
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, rotary, w, dtype) for w in layer_windows(cfg)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        x = self.embed_tokens(input_ids).to(self.compute_dtype)
        for layer in self.layers:
            x = layer(positions, x, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return torch.nn.functional.linear(hidden, w.to(hidden.dtype)).float()

    # ---- weights -------------------------------------------------------------------------
    _merged = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take (transformers name, tensor) pairs; fail naming any tensor that is missing."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in self._merged:
                merged, idx = self._merged[parts[-2]]
                target = ".".join(parts[:-2] + [merged])
                module = self.get_submodule(target)
                if parts[-1] == "weight":
                    module.load_part(idx, weight=tensor)
                else:
                    module.load_part(idx, bias=tensor)
                loaded.add(f"{target}.{parts[-1]}#{idx}")
                continue
            if name not in params:
                continue  # unused extras (e.g. rotary inv_freq buffers in old checkpoints)
            p = params[name]
            if tuple(p.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
            if p.dtype == tensor.dtype and p.device == tensor.device and tensor.is_contiguous():
                p.data = tensor  # take the loaded tensor as is: no second copy of the weights
            else:
                p.data.copy_(tensor)
            loaded.add(name)
        expected: set[str] = set()
        for pname, _ in self.named_parameters():
            module_name, _, leaf = pname.rpartition(".")
            module = self.get_submodule(module_name)
            if isinstance(module, MergedLinear):
                expected.update(f"{pname}#{i}" for i in range(len(module.sizes)))
            else:
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            # Report the checkpoint's names (k_proj), not the fused parameter's (qkv_proj.weight#1).
            unmerge = {v: k for k, v in self._merged.items()}
            for i, m in enumerate(missing):
                m, _, idx = m.partition("#")
                if idx:
                    *prefix, merged, leaf = m.split(".")
                    m = ".".join([*prefix, unmerge[(merged, int(idx))], leaf])
                missing[i] = m
            missing.sort()
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing weight tensors: {shown}")
