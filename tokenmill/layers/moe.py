"""Mixture-of-experts feed-forward: a router's top-k choice of E gated MLP experts per token.

Layout: every expert's weights stacked in two parameters, `w13_weight` [E, 2*I_shard, H] (gate rows then
up rows, as MergedColumnParallelLinear packs gate_up) and `w2_weight` [E, H, I_shard]. Under tensor
parallelism each rank holds its I_shard slice of every expert's intermediate dimension (gate/up rows,
down columns), cut when loading; the partial outputs are all-reduced once (`reduce_results`).

Compute is grouped: the T*k (token, expert) pairs are sorted by expert, each *active* expert runs one
gate_up GEMM and one down GEMM over its contiguous slice, the rows are scaled by their routing weights
and scattered back with one index_add_. The Python loop runs over experts, never over tokens; with few
tokens per expert (decode batches) float experts run in two native calls over all experts instead
(csrc/grouped_linear.cpp). Those paths read the per-expert counts on the host (a device sync); float experts
on CUDA take moe_triton.py instead: the pairs aligned by expert on the device and one Triton grouped GEMM
launch per projection, sync-free and CUDA-graph capturable (TOKENMILL_MOE_TRITON=0 turns it off; =1 selects
it on the CPU under TRITON_INTERPRET=1, for tests).

Loading: `weight_loader(param, tensor, shard_id)` with shard_id (expert or None, "w1"|"w3"|"w2"):
per-expert checkpoint tensors (experts.{e}.gate_proj/up_proj/down_proj, Mixtral's w1/w3/w2) or merged
[E, ...] ones (GGUF's ffn_{gate,up,down}_exps). `expert_target` maps a checkpoint name onto (parameter,
shard id) for the generic loader. A weight-only `--quantization int8|int4` quantizes each expert after
loading with the same packing and native kernels as the linear layers.
"""
from __future__ import annotations

import importlib.util
import os
import re

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import native
from tokenmill.layers import collectives
from tokenmill.layers.activation import act_fn, gated
from tokenmill.layers.linear import check_shape
from tokenmill.layers.quantization.base import QuantizationConfig
from tokenmill.layers.quantization.weight_only import (dequantize_int4, int8_matmul, packed_matmul, quantize_int4,
                                                      quantize_int8)

# checkpoint projection name -> our shard kind: w1 gate, w3 up (rows of w13), w2 down
EXPERT_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w3": "w3", "w2": "w2"}
_EXPERT_NAME = re.compile(
    r"^(.*\.experts)\.(?:(\d+)\.)?(gate_proj|up_proj|down_proj|w1|w2|w3)\.(weight|weight_scale_inv)$")


def expert_target(name: str) -> tuple[str, tuple[int | None, str]] | None:
    """"layers.0.mlp.experts.3.up_proj.weight" -> ("layers.0.mlp.experts.w13_weight", (3, "w3"));
    a merged "layers.0.mlp.experts.up_proj.weight" gets expert None; a block-scaled FP8 checkpoint's
    "...up_proj.weight_scale_inv" goes to w13_weight_scale_inv (a parameter only experts of that format have).
    None: not an expert tensor."""
    m = _EXPERT_NAME.match(name)
    if m is None:
        return None
    prefix, e, proj, leaf = m.groups()
    kind = EXPERT_PROJ[proj]
    return f"{prefix}.{'w2' if kind == 'w2' else 'w13'}_{leaf}", (None if e is None else int(e), kind)


# Up to this many tokens per expert, float experts run through tokenmill.grouped_linear (weight-stationary
# register tiles) instead of one SGEMM per expert, which spends as long packing W as multiplying at few rows.
# TOKENMILL_MOE_GROUPED=0 turns it off.
GROUPED_MAX_ROWS = 24  # measured crossover with per-expert SGEMM: 24-32 rows (2 threads, 1024x512 experts)


def _grouped(layer: nn.Module, xs: torch.Tensor, counts: list[int] | None = None) -> bool:
    return (type(layer.quant_method) is UnquantizedMoEMethod and xs.device.type == "cpu"  # (a CPU kernel)
            and xs.dtype == torch.float32
            and layer.w13_weight.dtype == torch.float32
            and (counts is None or max(counts, default=0) <= GROUPED_MAX_ROWS)
            and os.environ.get("TOKENMILL_MOE_GROUPED") != "0" and native.has_op("grouped_linear"))


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _triton(layer: nn.Module, x: torch.Tensor) -> bool:
    """The sync-free Triton path (moe_triton.py): float experts on CUDA unless TOKENMILL_MOE_TRITON=0; on the CPU
    only with TOKENMILL_MOE_TRITON=1 under TRITON_INTERPRET=1 (the tests' way to run the kernel)."""
    if type(layer.quant_method) is not UnquantizedMoEMethod or x.dtype not in _FLOATS \
            or layer.w13_weight.dtype not in _FLOATS:
        return False
    switch = os.environ.get("TOKENMILL_MOE_TRITON")
    if x.device.type == "cpu":
        on = switch == "1" and os.environ.get("TRITON_INTERPRET") == "1"
    else:
        on = x.device.type == "cuda" and switch != "0"
    # Found, not imported: Triton reads TRITON_INTERPRET when first imported (moe_triton imports it on first use).
    return on and importlib.util.find_spec("triton") is not None


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, top-k; `renormalize` rescales the k weights to sum to 1 (== a softmax over
    the top-k logits, Mixtral's router). -> (weights float32 [T, k], expert ids int64 [T, k])."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class UnquantizedMoEMethod:
    """Float experts: F.linear on one expert's slice of the stacked weight (upcast per call when stored
    in a narrower dtype, as the dense layers do)."""

    def create_weights(self, layer: nn.Module) -> None:
        pass  # FusedMoE's float w13_weight / w2_weight (a checkpoint format's method replaces them)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def linear(self, layer: nn.Module, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        w = _part(layer, name, "weight")[e]
        return F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype))


class Int8MoEMethod(UnquantizedMoEMethod):
    """Each expert's rows quantized like Int8LinearMethod: per-row scale, torch.ops.tokenmill.int8_linear."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        for name in ("w13", "w2"):
            w = _part(layer, name, "weight").data
            E, N, K = w.shape
            q, scale = quantize_int8(w.reshape(E * N, K))
            _swap(layer, name, qweight=q.reshape(E, N, K), scale=scale.reshape(E, N))

    def linear(self, layer: nn.Module, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        return int8_matmul(x, _part(layer, name, "qweight")[e], _part(layer, name, "scale")[e])


class Int4MoEMethod(UnquantizedMoEMethod):
    """Each expert packed like Int4LinearMethod (groups of input columns), torch.ops.tokenmill.int4_linear."""

    def __init__(self, group_size: int, symmetric: bool) -> None:
        self.group_size = group_size
        self.symmetric = symmetric

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        g = self.group_size
        for name in ("w13", "w2"):
            w = _part(layer, name, "weight").data
            E, N, K = w.shape
            if K % g:
                raise ValueError(f"int4 group size {g} does not divide the input size {K} of {layer.prefix}.{name}")
            packed, scale, zero = quantize_int4(w.reshape(E * N, K), g, self.symmetric)
            _swap(layer, name, qweight=packed.reshape(E, N, -1), scale=scale.reshape(E, N, -1),
                  zero=zero.reshape(E, N, -1))

    def linear(self, layer: nn.Module, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        q, s, z = (_part(layer, name, p)[e] for p in ("qweight", "scale", "zero"))
        g = self.group_size
        return packed_matmul(x, lambda x2, b: torch.ops.tokenmill.int4_linear(x2, q, s, z, g, b),
                             lambda: dequantize_int4(q, s, z, g))


def _part(layer: nn.Module, name: str, part: str) -> torch.Tensor:
    """The stacked experts' tensor `part` of w13 / w2 (w13_weight, w2_qweight, ...)."""
    return getattr(layer, f"{name}_{part}")  # getattr: FusedMoE's parameters by name, as _swap registers them


def _swap(layer: nn.Module, name: str, **packed: torch.Tensor) -> None:
    delattr(layer, f"{name}_weight")
    for part, t in packed.items():
        layer.register_parameter(f"{name}_{part}", nn.Parameter(t.contiguous(), requires_grad=False))


def moe_method(quant_config: QuantizationConfig | None) -> UnquantizedMoEMethod:
    """int8/int4 weight-only configs quantize the experts; GGUF experts are dequantized at load (float);
    block-scaled FP8 checkpoints (DeepSeek-V3) keep them FP8; other pre-quantized formats have no MoE path yet."""
    from tokenmill.layers.quantization.weight_only import WeightOnlyConfig

    if quant_config is not None and quant_config.name == "fp8":
        from tokenmill.layers.quantization.fp8_block import Fp8BlockConfig, Fp8BlockMoEMethod

        if isinstance(quant_config, Fp8BlockConfig):
            return Fp8BlockMoEMethod(quant_config.block)

    if isinstance(quant_config, WeightOnlyConfig):
        if quant_config.name == "int8":
            return Int8MoEMethod()
        return Int4MoEMethod(quant_config.group_size, quant_config.symmetric)
    if quant_config is not None and quant_config.name != "gguf":
        raise NotImplementedError(f"mixture-of-experts layers with {quant_config.name!r} "
                                  f"quantization are not supported")
    return UnquantizedMoEMethod()


class FusedMoE(nn.Module):
    """All experts of one layer; forward(x [T, H], weights [T, k], ids [T, k]) -> [T, H]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str = "silu",
                 reduce_results: bool = True, tp_rank: int = 0, tp_size: int = 1,
                 params_dtype: torch.dtype = torch.float32, quant_config: QuantizationConfig | None = None,
                 prefix: str = "", ep_rank: int = 0, ep_size: int = 1) -> None:
        super().__init__()
        if intermediate_size % tp_size:
            raise ValueError(f"expert intermediate size {intermediate_size} does not divide over tensor-parallel "
                             f"size {tp_size}")
        if num_experts % ep_size:
            raise ValueError(f"{num_experts} experts do not divide over expert-parallel size {ep_size}")
        # Expert parallel: this rank holds experts [first, first + local) whole; the others are skipped.
        self.num_experts = num_experts
        self.local = num_experts // ep_size
        self.first = ep_rank * self.local
        self.ep_size = ep_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.shard = intermediate_size // tp_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.reduce_results = reduce_results
        self.prefix = prefix
        self.act_name, self.act = activation, act_fn(activation)
        self.quant_method = moe_method(quant_config)
        self.w13_weight = nn.Parameter(torch.empty(self.local, 2 * self.shard, hidden_size, dtype=params_dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(self.local, hidden_size, self.shard, dtype=params_dtype),
                                      requires_grad=False)
        for p in (self.w13_weight, self.w2_weight):
            p.weight_loader = self.weight_loader
        self.loaded: set[tuple[int, str]] = set()
        self.kinds: tuple[str, ...] = ("w1", "w3", "w2")  # what each expert needs loaded (+ a format's scales)
        self.quant_method.create_weights(self)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[1] in ("w1", "w3", "w2")):
            raise ValueError(f"is an expert tensor without an (expert, w1|w3|w2) shard id (got {shard_id!r})")
        expert, kind = shard_id
        I, H, s, r = self.intermediate_size, self.hidden_size, self.shard, self.tp_rank
        full = (H, I) if kind == "w2" else (I, H)
        check_shape(loaded, full if expert is not None else (self.num_experts, *full))
        if expert is None:  # merged [E, ...]: this rank's experts
            loaded = loaded.narrow(0, self.first, self.local)
        elif not self.first <= expert < self.first + self.local:
            return  # another rank's expert
        dst = param.data if expert is None else param.data[expert - self.first]
        if kind == "w2":
            dst.copy_(loaded.narrow(-1, r * s, s))
        else:
            dst.narrow(-2, 0 if kind == "w1" else s, s).copy_(loaded.narrow(-2, r * s, s))
        experts = range(self.first, self.first + self.local) if expert is None else (expert,)
        self.loaded.update((e, kind) for e in experts)

    def unloaded(self) -> list[str]:
        """Checkpoint names of the expert tensors not loaded (for the loader's missing-weights error)."""
        names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
        return [f"{self.prefix}.{e}.{names[k[:2]]}.{'weight_scale_inv' if k.endswith('_scale') else 'weight'}"
                for e in range(self.first, self.first + self.local) for k in self.kinds if (e, k) not in self.loaded]

    def complete(self) -> bool:
        """Every tensor of this rank's experts is in."""
        return len(self.loaded) >= len(self.kinds) * self.local

    def graph_safe(self) -> bool:
        """Whether a CUDA graph can capture this layer's forward (executor/cuda_graphs.py): only the Triton path
        reads nothing on the host (the others copy expert ids or counts there). The weights' device and dtype
        stand in for the activations' (the model computes in its weights' dtype)."""
        return _triton(self, self.w13_weight[:0])

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """topk_ids are global expert ids; under expert parallelism only this rank's experts run (the
        partial outputs are summed by the caller's all-reduce)."""
        T, k = topk_ids.shape
        if _triton(self, x):  # before anything below reads expert ids or counts on the host
            from tokenmill.layers.moe_triton import fused_moe_triton

            return self._reduce(fused_moe_triton(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                                                 self.first, self.local, self.act_name))
        if T == 1 and not _grouped(self, x):  # batch-1 decode: the k experts in turn, no sort or scatter
            out = None
            for e, w in zip(topk_ids[0].tolist(), topk_weights[0].to(x.dtype)):
                e -= self.first
                if not 0 <= e < self.local:
                    continue
                h = gated(self.quant_method.linear(self, "w13", e, x), self.act, self.act_name)
                y = self.quant_method.linear(self, "w2", e, h).mul_(w)
                out = y if out is None else out.add_(y)
            return self._reduce(out if out is not None else torch.zeros_like(x))
        flat = topk_ids.reshape(-1) - self.first
        if self.ep_size > 1:  # pairs routed to other ranks' experts sort past the end and are never run
            flat = torch.where((flat >= 0) & (flat < self.local), flat, self.local)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.local + 1).tolist()[: self.local]
        n_local = sum(counts)
        order = order[:n_local]
        tokens = order // k
        xs = x.index_select(0, tokens)
        ws = topk_weights.reshape(-1).index_select(0, order).to(x.dtype).unsqueeze(1)
        method = self.quant_method
        if _grouped(self, xs, counts):
            # Few tokens per expert (decode batches): all experts in two native calls, weights read once.
            c = torch.tensor(counts, dtype=torch.int64)
            h = gated(torch.ops.tokenmill.grouped_linear(xs, self.w13_weight, c), self.act, self.act_name)
            ys = torch.ops.tokenmill.grouped_linear(h, self.w2_weight, c).mul_(ws)
            return self._reduce(torch.zeros_like(x).index_add_(0, tokens, ys))
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            end = start + n
            h = gated(method.linear(self, "w13", e, xs[start:end]), self.act, self.act_name)
            torch.mul(method.linear(self, "w2", e, h), ws[start:end], out=ys[start:end])
            start = end
        return self._reduce(torch.zeros_like(x).index_add_(0, tokens, ys))

    def _reduce(self, out: torch.Tensor) -> torch.Tensor:
        if self.reduce_results and self.tp_size > 1:
            collectives.all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts} (here {self.first}..{self.first + self.local - 1}), "
                f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, tp={self.tp_rank}/{self.tp_size}, "
                f"quant={type(self.quant_method).__name__}")
