"""Block-scaled FP8 checkpoints (DeepSeek-V3's own form): quant_method "fp8" with `weight_block_size` [bn, bk].

Each quantized linear stores `weight` float8_e4m3fn [N, K] and `weight_scale_inv` float32 [ceil(N / bn),
ceil(K / bk)]: W[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk] (despite its name, the multiplier).
MoE experts the same, per expert (`experts.{e}.{gate,up,down}_proj.weight` / `.weight_scale_inv`).

Kept in memory: the weight as its bytes, and the scale per output row and K-block, float32 [N, ceil(K / bk)]. Per
row because a fused layer (qkv, gate_up) stacks parts that each start their own row blocks, so rows are the grid
they share; 4 bytes per bk weights (3% of the weight's bytes at bk = 128). Under tensor parallelism a layer split
along K (o_proj, down_proj, the experts' down) needs each rank's K range to start on a block, else the load is
refused naming the layer.

`apply` converts a tile of rows at a time to float32, scales it and multiplies: the numerics of the float layer on
the dequantized weight (bounded temporary memory; no native kernel yet). Layers the checkpoint leaves in float
(the embeddings, lm_head, the router, norms) are not linear layers with this method and load as float.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.quantization.base import QuantizeMethodBase, set_weight_attrs
from tokenmill.layers.quantization.fp8 import FP8, TILE_ELEMENTS, Fp8Config, _load_weight, _part_rows


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dequantize_block_fp8(weight: torch.Tensor, scale_rows: torch.Tensor, bk: int) -> torch.Tensor:
    """weight [N, K] fp8, scale_rows [N, ceil(K / bk)] -> float32 [N, K]."""
    K = weight.shape[-1]
    return weight.float() * scale_rows.float().repeat_interleave(bk, dim=-1)[..., :K]


def block_fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale_rows: torch.Tensor, bk: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantized(weight)^T (+ bias) in float32, a tile of rows at a time; returns x's dtype."""
    N, K = weight.shape
    x2 = x.reshape(-1, K).float()
    b = None if bias is None else bias.float()
    rows = max(1, TILE_ELEMENTS // max(K, 1))
    if rows >= N:
        y = F.linear(x2, dequantize_block_fp8(weight, scale_rows, bk), b)
    else:
        y = torch.cat([F.linear(x2, dequantize_block_fp8(weight[n:n + rows], scale_rows[n:n + rows], bk),
                                None if b is None else b[n:n + rows]) for n in range(0, N, rows)], dim=-1)
    return y.to(x.dtype).reshape(*x.shape[:-1], N)


def expand_rows(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """A checkpoint scale [..., ceil(rows / bn), ceil(cols / bk)] -> per row [..., rows, ceil(cols / bk)]."""
    bn, bk = block
    want = (_cdiv(rows, bn), _cdiv(cols, bk))
    if tuple(scale.shape[-2:]) != want:
        raise ValueError(f"has shape {tuple(scale.shape)}: expected [..., {want[0]}, {want[1]}] (blocks of "
                         f"{bn} x {bk} over [{rows}, {cols}])")
    if not torch.isfinite(scale).all():
        raise ValueError("holds non-finite scales")
    return scale.float().repeat_interleave(bn, dim=-2).narrow(-2, 0, rows)


def k_block_range(start: int, size: int, bk: int, where: str) -> tuple[int, int]:
    """The scale columns of input columns [start, start + size): they must start on a block."""
    if start % bk:
        raise ValueError(f"{where}: a rank's input columns start at {start}, inside a {bk}-wide scale block of "
                         "the fp8 checkpoint (use a tensor-parallel size that splits on whole blocks)")
    return start // bk, _cdiv(size, bk)


def check_k_split(per_rank: int, tp_size: int, bk: int, where: str) -> None:
    """Every rank's input columns start on a block (checked on every rank alike, at build: each refuses the
    same, none waits in a collective for a peer that failed)."""
    if tp_size > 1:
        k_block_range(per_rank, per_rank, bk, where)  # rank 1's start; the others' are its multiples


class Fp8BlockConfig(Fp8Config):
    """quant_method fp8 with weight_block_size: linear layers and MoE experts stay FP8 with their block scales."""

    def __init__(self, block: tuple[int, int], ignored: tuple[str, ...] = ()) -> None:
        super().__init__(ignored)
        self.block = block

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from tokenmill.layers.quantization.gptq_awq import skipped

        if skipped(prefix, self.ignored):
            return None
        return Fp8BlockLinearMethod(self.block)


def parse_block(raw: dict, where: str) -> Fp8BlockConfig:
    block = raw["weight_block_size"]
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{where}: weight_block_size must be two positive ints [rows, columns], got {block!r}")
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"{where}: block-wise fp8 with activation_scheme {raw['activation_scheme']!r} is not "
                         "supported (only dynamic: activations stay float here)")
    return Fp8BlockConfig((block[0], block[1]), tuple(raw.get("modules_to_not_convert") or ()))


class Fp8BlockLinearMethod(QuantizeMethodBase):
    def __init__(self, block: tuple[int, int]) -> None:
        self.block = block

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        N, bk = sum(output_partition_sizes), self.block[1]
        if input_size_per_partition != input_size:
            check_k_split(input_size_per_partition, layer.tp_size, bk, layer.prefix)
        loader = extra_weight_attrs.pop("weight_loader")
        weight = nn.Parameter(torch.empty(N, input_size_per_partition, dtype=FP8), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs,
                                  "weight_loader": lambda p, t, shard_id=None: _load_weight(loader, p, t, shard_id)})
        layer.register_parameter("weight", weight)
        scale = nn.Parameter(torch.empty(N, _cdiv(input_size_per_partition, bk), dtype=torch.float32),
                             requires_grad=False)
        set_weight_attrs(scale, {"output_dim": 0, **extra_weight_attrs,
                                 "weight_loader": lambda p, t, shard_id=None: self._load_scale(layer, loader, p, t,
                                                                                               shard_id)})
        layer.register_parameter("weight_scale_inv", scale)

    def _load_scale(self, layer: nn.Module, loader, param: torch.Tensor, loaded: torch.Tensor, shard_id) -> None:
        """The part's block scales spread over its rows; a layer split along K keeps its ranks' columns here (the
        scale has no input_dim, so the layer's loader cuts rows only)."""
        K, Kp = layer.input_size, layer.input_size_per_partition
        rows = expand_rows(loaded, _part_rows(layer, shard_id), K, self.block)
        if Kp != K:
            first, n = k_block_range(layer.tp_rank * Kp, Kp, self.block[1], layer.prefix)
            rows = rows.narrow(1, first, n)
        loader(param, rows.contiguous(), shard_id)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return block_fp8_matmul(x, layer.weight, layer.weight_scale_inv, self.block[1], bias)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return dequantize_block_fp8(layer.weight, layer.weight_scale_inv, self.block[1])


class Fp8BlockMoEMethod:
    """FusedMoE's experts as FP8 with per-row block scales: w13_weight [E, 2 * I_shard, H] and w2_weight
    [E, H, I_shard] float8_e4m3fn, w13_weight_scale_inv [E, 2 * I_shard, ceil(H / bk)] and w2_weight_scale_inv
    [E, H, ceil(I_shard / bk)]. Each active expert's slice is dequantized for its GEMM."""

    def __init__(self, block: tuple[int, int]) -> None:
        self.block = block

    def create_weights(self, layer: nn.Module) -> None:
        bk = self.block[1]
        E, s, H = layer.local, layer.shard, layer.hidden_size
        check_k_split(s, layer.tp_size, bk, f"{layer.prefix} (down_proj)")
        for name, shape, scale_shape in (("w13", (E, 2 * s, H), (E, 2 * s, _cdiv(H, bk))),
                                         ("w2", (E, H, s), (E, H, _cdiv(s, bk)))):
            weight = nn.Parameter(torch.empty(shape, dtype=FP8), requires_grad=False)
            weight.weight_loader = lambda p, t, shard_id=None: self._load_weight(layer, p, t, shard_id)
            layer.register_parameter(f"{name}_weight", weight)
            scale = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32), requires_grad=False)
            scale.weight_loader = lambda p, t, shard_id=None: self._load_scale(layer, p, t, shard_id)
            layer.register_parameter(f"{name}_weight_scale_inv", scale)
        layer.kinds = (*layer.kinds, "w1_scale", "w3_scale", "w2_scale")

    @staticmethod
    def _load_weight(layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor, shard_id) -> None:
        if loaded.dtype != FP8:
            raise ValueError(f"has dtype {loaded.dtype}, expected {FP8} (an fp8 checkpoint)")
        layer.weight_loader(param, loaded, shard_id)

    def _load_scale(self, layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor, shard_id) -> None:
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[1] in ("w1", "w3", "w2")):
            raise ValueError(f"is an expert scale without an (expert, w1|w3|w2) shard id (got {shard_id!r})")
        expert, kind = shard_id
        I, H, s, r = layer.intermediate_size, layer.hidden_size, layer.shard, layer.tp_rank
        rows, cols = (H, I) if kind == "w2" else (I, H)
        if expert is None:  # merged [E, ...]: this rank's experts
            if loaded.dim() != 3 or loaded.shape[0] != layer.num_experts:
                raise ValueError(f"has shape {tuple(loaded.shape)}: expected [{layer.num_experts}, ...] (all experts)")
            loaded = loaded.narrow(0, layer.first, layer.local)
        elif not layer.first <= expert < layer.first + layer.local:
            return  # another rank's expert
        per_row = expand_rows(loaded, rows, cols, self.block)
        dst = param.data if expert is None else param.data[expert - layer.first]
        if kind == "w2":
            first, n = k_block_range(r * s, s, self.block[1], layer.prefix)
            dst.copy_(per_row.narrow(-1, first, n))
        else:
            dst.narrow(-2, 0 if kind == "w1" else s, s).copy_(per_row.narrow(-2, r * s, s))
        experts = range(layer.first, layer.first + layer.local) if expert is None else (expert,)
        layer.loaded.update((e, f"{kind}_scale") for e in experts)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass  # kept as loaded

    def linear(self, layer: nn.Module, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        w = layer.w13_weight if name == "w13" else layer.w2_weight
        scale = layer.w13_weight_scale_inv if name == "w13" else layer.w2_weight_scale_inv
        return block_fp8_matmul(x, w[e], scale[e], self.block[1])
