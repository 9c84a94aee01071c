"""A decoder stack's layers in one native call per step (csrc/decoder_stack.cpp).

The C++ side runs the same kernels in the same order as model/blocks.py's layers do on a float32 CPU batch
(fused norms, rotary, cpu_paged attention, the quant method's matmul), so the output is bit for bit the
Python path's; what goes away is the Python between the kernels, a third of a batch-1 decode step.

`NativeStack.build(model)` says whether a model qualifies (`why_not` names the first thing that does not):
float32 compute on the CPU with the native kernels, pre-norm layers with a dense gated MLP, tensor-parallel
size 1, linear layers whose quant method has a `native_linear` form, and the cpu_paged backend with a float32
or bfloat16 cache (checked per step: the cache is allocated after the model). Anything else keeps the
Python layers, as does TOKENMILL_NATIVE_STACK=0 (the switch, for comparing the two).
"""
from __future__ import annotations

import logging
import os

import torch

from tokenmill import native
from tokenmill.layers import fused
from tokenmill.layers.attention_backends.cpu_paged import CPUPagedMetadata
from tokenmill.layers.quantization.base import NativeLinear

log = logging.getLogger(__name__)

ENV = "TOKENMILL_NATIVE_STACK"
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
CACHE_DTYPES = (torch.float32, torch.bfloat16)


def switched_on() -> bool:
    """The switch, read at every forward (a test or benchmark may flip it on a built model)."""
    return os.environ.get(ENV, "1") != "0"


def enabled() -> bool:
    return switched_on() and fused.ENABLED and native.available() and _has_class()


def _has_class() -> bool:
    try:
        torch.classes.tokenmill.DecoderStack  # noqa: B018 - an older build lacks it
    except (RuntimeError, AttributeError):
        return False
    return True


def _linear(layer) -> NativeLinear | None:
    if layer.tp_size != 1:
        return None
    return layer.quant_method.native_linear(layer)


def _layer_reason(layer) -> str | None:
    """Why this DecoderLayer cannot run natively, or None."""
    from tokenmill.model.blocks import AttentionBlock, DecoderLayer, MLPBlock

    attn, mlp = (layer.self_attn, layer.mlp) if isinstance(layer, DecoderLayer) else (None, None)
    if not isinstance(attn, AttentionBlock) or not isinstance(mlp, MLPBlock):
        return f"{type(layer).__name__}: not an attention block and a dense MLP"
    if layer.sandwich:
        return "sandwich norms"
    if layer.post_norms:
        return "post-norms only (OLMo 2)"
    if layer.residual_multiplier is not None:
        return "residual multiplier (Granite)"
    if attn.qk_norm_all_heads:
        return "q/k norms over all heads (OLMo 2)"
    if attn.attn.sinks is not None:
        return "attention sinks (gpt-oss)"
    if attn.rotary.rotary_dim != attn.head_dim:
        return "partial rotary"
    if attn.rotary.interleaved:
        return "interleaved rotary"
    if mlp.act_name not in ACTIVATIONS:
        return f"activation {mlp.act_name}"
    norms = [layer.input_layernorm, layer.post_attention_layernorm] + ([attn.q_norm, attn.k_norm] if attn.qk_norm
                                                                      else [])
    if any(n.weight.dtype != torch.float32 for n in norms):
        return "norm weights not float32"
    if attn.rotary.cos.dtype != torch.float32:
        return "rotary table not float32"
    for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        if _linear(lin) is None:
            return f"{lin.prefix}: {type(lin.quant_method).__name__} at tp {lin.tp_size} has no native form"
    return None


class NativeStack:
    def __init__(self, layers: list) -> None:
        self.layers = layers
        self.stack = torch.classes.tokenmill.DecoderStack()
        self.attn = [layer.self_attn.attn for layer in layers]
        self.caches: list[torch.Tensor | None] = [None] * len(layers)
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            idx = [self._add(_linear(lin)) for lin in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)]
            n = layer.input_layernorm
            at = a.attn
            self.stack.add_layer(
                n.weight, layer.post_attention_layernorm.weight, float(n.eps), float(n.offset),
                a.q_norm.weight if a.qk_norm else None, a.k_norm.weight if a.qk_norm else None, *idx,
                a.num_heads, a.num_kv_heads, a.head_dim, float(at.scale), int(at.sliding_window or 0),
                float(at.logits_soft_cap or 0.0), a.rotary.cos, a.rotary.sin, ACTIVATIONS[m.act_name])

    def _add(self, lin: NativeLinear) -> int:
        return self.stack.add_linear(lin.kind, lin.weight, lin.bias, lin.scale, lin.zero, lin.qtype, lin.K, lin.group,
                                     lin.int8_activations, lin.bf16_batches)

    @staticmethod
    def why_not(model) -> str | None:
        if not enabled():
            return f"{ENV}=0, fused ops off, or native kernels without DecoderStack"
        store = model.weight_store
        if store is not None and store.streamed:
            return "decoder layers streamed (--weights-resident-gb, --cpu-offload-gb): each layer's forward is hooked"
        if model.compute_dtype != torch.float32:
            return f"compute dtype {model.compute_dtype}"
        if not model.own_layers:
            return "no layers"
        for layer in model.own_layers:
            if next(layer.parameters()).device.type != "cpu":
                return "not on the CPU"
            reason = _layer_reason(layer)
            if reason is not None:
                return reason
        return None

    @classmethod
    def build(cls, model) -> NativeStack | None:
        reason = cls.why_not(model)
        if reason is not None:
            log.debug("native decoder stack off: %s", reason)
            return None
        return cls(list(model.own_layers))

    def ready(self, meta) -> bool:
        """This step can run natively: cpu_paged metadata and float caches (rebound if reallocated)."""
        if type(meta) is not CPUPagedMetadata or meta.tree_group is not None:  # trees: attended in torch too
            return False
        for i, a in enumerate(self.attn):
            k = a.k_cache
            if k is not self.caches[i]:
                if k is None or k.dtype not in CACHE_DTYPES or a.v_cache.dtype != k.dtype:
                    return False
                self.stack.set_kv_cache(i, k, a.v_cache)
                self.caches[i] = k
        return True

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        timer = self.attn[0].timer
        x, residual, attn_s = self.stack.forward(x, residual, positions, meta.slot_mapping, meta.block_table,
                                                 meta.query_start, meta.query_len, meta.kv_len, timer is not None)
        if timer is not None:
            timer.total += attn_s
        return x, residual
