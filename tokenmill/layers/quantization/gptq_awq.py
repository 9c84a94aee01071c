"""GPTQ and AWQ int4 checkpoints, repacked at load into the int4 kernel format of weight_only.py.

Both store, per linear layer, 4-bit values eight to an int32 (value j of a word in bits 4j..4j+3),
one scale per (group of input columns, output column) and a 4-bit zero point packed the same way;
the float weight is W[n, k] = (q[k, n] - zero[k // g, n]) * scale[k // g, n]:

- GPTQ (AutoGPTQ / optimum): `qweight` [K/8, N] packed along K (the input), `qzeros` [K/g, N/8]
  packed along N, `scales` [K/g, N], `g_idx` [K]: the group of each input column, k // g, or with
  desc_act (act-order) any assignment of g columns to each group. The common "v1" checkpoints store
  zero - 1 (the nibble read back + 1 is the zero, 1..16); gptq_v2 checkpoints store the zero itself.
  group_size -1: one group over all of K.
- AWQ (GEMM version): `qweight` [K, N/8] packed along N, value j of a word holding column
  AWQ_ORDER[j] of its eight, `qzeros` [K/g, N/8] packed the same way, `scales` [K/g, N].

The parameters are created with the checkpoint's names and layouts, so the normal loader fills them
(fused qkv / gate_up concatenate along N, tensor-parallel shards cut along N or K, in stored units via
`pack_factors`); `process_weights_after_loading` unpacks them into packed uint8 [N, K/2] (even column
in the low nibble) with float32 scale/zero [N, K/g], a lossless transform, and the layer then runs
exactly like `--quantization int4` (the native int4_linear kernel, or dequantize + F.linear).
Act-order: the input columns are sorted by group at load (W[:, perm], groups contiguous again) and
`apply` gathers x[..., perm] first, one index_select per layer call; a row-parallel layer split over
ranks would need groups cut mid-way, so act-order with tensor parallelism there is refused.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.quantization.base import QuantizationConfig, QuantizeMethodBase, layer_name, set_weight_attrs
from tokenmill.layers.quantization.registry import checkpoint_format
from tokenmill.layers.quantization.weight_only import Int4LinearMethod

PACK = 8  # int4 values per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ word holds column AWQ_ORDER[j] of its eight
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_int32(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> uint8 nibbles, eight per word laid out along `dim` (value j from bits 4j..4j+3)."""
    nib = (words.unsqueeze(-1) >> _SHIFTS) & 0xF  # [..., 8] after the last dim
    nib = nib.movedim(-1, dim + 1) if dim != words.dim() - 1 else nib
    shape = list(words.shape)
    shape[dim] *= PACK
    return nib.reshape(shape).to(torch.uint8)


def pack_int32(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of unpack_int32: nibbles (0..15) along `dim`, eight to an int32 word."""
    shape = list(values.shape)
    if shape[dim] % PACK:
        raise ValueError(f"{shape[dim]} values along dim {dim} do not fill int32 words of {PACK}")
    v = values.to(torch.int64).reshape(shape[:dim] + [shape[dim] // PACK, PACK] + shape[dim + 1:])
    v = v.movedim(dim + 1, -1) << _SHIFTS.to(torch.int64)
    words = v.sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """AWQ [R, N/8] int32 -> [R, N] uint8 in column order."""
    nib = unpack_int32(words, words.dim() - 1).reshape(*words.shape, PACK)  # nibble j of each word
    inverse = torch.tensor(AWQ_ORDER).argsort()  # column c sits in nibble inverse[c]
    return nib[..., inverse].reshape(*words.shape[:-1], -1)


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """[R, N] nibbles in column order -> AWQ [R, N/8] int32 (nibble j = column AWQ_ORDER[j])."""
    v = values.reshape(*values.shape[:-1], -1, PACK)[..., list(AWQ_ORDER)]
    return pack_int32(v.reshape(values.shape), values.dim() - 1)


def skipped(prefix: str, ignored: tuple[str, ...]) -> bool:
    """Whether layer `prefix` (e.g. layers.0.mlp.down_proj) is one of the checkpoint's float modules."""
    return any(prefix == p or prefix.endswith("." + p) or prefix.startswith(p + ".") for p in ignored)


def pack_rows_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] nibbles -> the kernel's uint8 [N, K/2], even column in the low nibble."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


class Int4CheckpointConfig(QuantizationConfig):
    """quantization_config of a GPTQ or AWQ checkpoint (4 bits only)."""

    def __init__(self, name: str, group_size: int, zero_plus_one: bool = False, ignored: tuple[str, ...] = (),
                 act_order: bool = False) -> None:
        if name not in ("gptq", "awq"):
            raise ValueError(f"not an int4 checkpoint format: {name!r}")
        if group_size != -1 and (group_size <= 0 or group_size % 2):
            raise ValueError(f"{name} group_size must be -1 or a positive even number, got {group_size}")
        self.name = name
        self.group_size = group_size
        self.zero_plus_one = zero_plus_one  # GPTQ v1: the stored zero is the zero - 1
        self.ignored = tuple(p.removeprefix("model.") for p in ignored)  # modules_to_not_convert: kept float
        self.act_order = act_order and name == "gptq"  # desc_act: g_idx is any grouping of the columns

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if skipped(prefix, self.ignored):
            return None
        return Int4CheckpointMethod(self)


def _int4_common(raw: dict, where: str, method: str) -> tuple[int, tuple[str, ...]]:
    """What GPTQ and AWQ configs share: 4 bits, the group size, the modules kept float."""
    bits = raw.get("bits", raw.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{where}: {method} with bits={bits!r} is not supported (4 bits only)")
    group = int(raw.get("group_size", raw.get("q_group_size", 128)))
    if raw.get("lm_head") or raw.get("dynamic"):
        raise ValueError(f"{where}: a quantized lm_head or per-module 'dynamic' overrides are not supported")
    return group, tuple(raw.get("modules_to_not_convert") or ())


@checkpoint_format("gptq")
def parse_gptq(raw: dict, where: str) -> Int4CheckpointConfig:
    group, ignored = _int4_common(raw, where, "gptq")
    fmt = str(raw.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    return Int4CheckpointConfig("gptq", group, zero_plus_one=fmt == "gptq", ignored=ignored,
                                act_order=bool(raw.get("desc_act")))


@checkpoint_format("awq")
def parse_awq(raw: dict, where: str) -> Int4CheckpointConfig:
    group, ignored = _int4_common(raw, where, "awq")
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"{where}: AWQ version {version!r} is not supported (gemm only)")
    if raw.get("zero_point") is False:
        raise ValueError(f"{where}: AWQ with zero_point=false is not supported (qzeros are expected)")
    return Int4CheckpointConfig("awq", group, ignored=ignored)


class Int4CheckpointMethod(Int4LinearMethod):
    """Loads a GPTQ/AWQ layer in its checkpoint layout; computes as Int4LinearMethod once repacked."""

    def __init__(self, config: Int4CheckpointConfig) -> None:
        super().__init__(config.group_size, symmetric=False)
        self.config = config
        self._g_idx_loaded = False
        self.permuted = False  # GPTQ act-order with groups out of order: the layer's `perm` buffer, set at load

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        fmt, where = self.config.name, layer_name(layer)
        K, N = input_size_per_partition, sum(output_partition_sizes)
        per_channel = self.config.group_size == -1
        g = K if per_channel else self.config.group_size
        if K % g or K % PACK:
            raise ValueError(f"{fmt} group size {g} does not divide the input size {K} of layer {where}")
        if any(n % PACK for n in output_partition_sizes):
            raise ValueError(f"{fmt}: output sizes {output_partition_sizes} of layer {where} are not multiples of "
                             f"{PACK} (int4 packed into int32)")
        if self.config.act_order and K != input_size:
            raise NotImplementedError(f"act-order (desc_act) GPTQ with the input of layer {where} split over "
                                      "tensor-parallel ranks is not supported")
        self.group_size = g
        G = K // g
        group_dim = None if per_channel else 0  # one group over all of K is not cut by tensor parallelism
        if fmt == "gptq":
            shapes = {"qweight": ((K // PACK, N), torch.int32, {0: PACK}, 0),
                      "qzeros": ((G, N // PACK), torch.int32, {0: g, 1: PACK}, group_dim),
                      "scales": ((G, N), params_dtype, {0: g}, group_dim)}
        else:
            shapes = {"qweight": ((K, N // PACK), torch.int32, {1: PACK}, 0),
                      "qzeros": ((G, N // PACK), torch.int32, {0: g, 1: PACK}, group_dim),
                      "scales": ((G, N), params_dtype, {0: g}, group_dim)}
        for name, (shape, dtype, factors, input_dim) in shapes.items():
            p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            factors = {d: f for d, f in factors.items() if d != 0 or input_dim is not None}
            set_weight_attrs(p, {"input_dim": input_dim, "output_dim": 1, "pack_factors": factors})
            set_weight_attrs(p, extra_weight_attrs)
            layer.register_parameter(name, p)
        if fmt == "gptq":
            g_idx = nn.Parameter(torch.empty(K, dtype=torch.int32), requires_grad=False)
            set_weight_attrs(g_idx, {"weight_loader": lambda p, t, shard_id=None: self._load_g_idx(layer, p, t)})
            layer.register_parameter("g_idx", g_idx)

    def _load_g_idx(self, layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor) -> None:
        """The same [K] tensor for every part of a fused layer; a row-parallel rank takes its slice.
        Without desc_act it must be the trivial order k // group; with it, g columns in each group."""
        K = param.shape[0]
        if self.config.act_order:
            self._load_act_order(param, loaded)
            return
        full = K * layer.tp_size if loaded.shape == (K * layer.tp_size,) and layer.tp_size > 1 else K
        if tuple(loaded.shape) != (full,):
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected ({full},)")
        start = layer.tp_rank * K if full != K else 0
        want = (torch.arange(full) // (self.config.group_size if self.config.group_size != -1 else full))
        if not torch.equal(loaded.to(torch.int64), want):
            raise ValueError("is not the trivial order k // group_size: act-order (desc_act) GPTQ checkpoints are "
                             "not supported")
        param.data.copy_(loaded[start:start + K])

    def _load_act_order(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        K, g = param.shape[0], self.group_size
        if tuple(loaded.shape) != (K,):
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected ({K},)")
        idx = loaded.to(torch.int64)
        if int(idx.min()) < 0 or int(idx.max()) >= K // g or \
                not (torch.bincount(idx, minlength=K // g) == g).all():
            raise ValueError(f"is not a grouping of the {K} input columns into {K // g} groups of {g}")
        if self._g_idx_loaded and not torch.equal(param.data.to(torch.int64), idx):
            raise ValueError("differs between the parts of a fused layer (they share one input, so one order)")
        param.data.copy_(loaded)
        self._g_idx_loaded = True

    def native_linear(self, layer: nn.Module):
        if self.permuted:
            return None  # act-order gathers x's columns first; the native stack does not
        return super().native_linear(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.permuted:  # act-order: the weight's columns are sorted by group
            x = x.index_select(-1, layer.perm)
        return super().apply(layer, x, bias)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.config.name == "gptq":
            q = unpack_int32(layer.qweight.data, 0)  # [K, N]
            zeros = unpack_int32(layer.qzeros.data, 1).float()  # [G, N]
            if self.config.zero_plus_one:
                zeros += 1
        else:
            q = awq_unpack(layer.qweight.data)
            zeros = awq_unpack(layer.qzeros.data).float()
        perm = None
        if self.config.act_order:
            g_idx = layer.g_idx.data.to(torch.int64)
            if not torch.equal(g_idx, torch.arange(g_idx.numel()) // self.group_size):
                perm = torch.argsort(g_idx, stable=True)  # columns of group 0, then group 1, ...
                q = q[perm]
        packed = pack_rows_int4(q.T.contiguous())
        scale = layer.scales.data.float().T.contiguous()
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            if hasattr(layer, name):
                delattr(layer, name)
        for name, t in (("qweight", packed), ("scale", scale), ("zero", zeros.T.contiguous())):
            layer.register_parameter(name, nn.Parameter(t, requires_grad=False))
        if perm is not None:
            layer.register_buffer("perm", perm)
        self.permuted = perm is not None
