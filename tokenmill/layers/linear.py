"""Linear layers that can be quantized and sharded over tensor-parallel ranks.

Each layer holds only its rank's shard. Its quant method creates the weight parameters and does the
matmul; every parameter carries `weight_loader(param, loaded_weight, shard_id=None)`, which takes the
full checkpoint tensor, cuts out this rank's shard and copies it into place (for packed layers, into
that shard's rows). With tp_size=1 nothing is cut and no collective runs.

Collectives use the default torch.distributed group: tensor parallelism is the only kind there is.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from tokenmill.layers import collectives
from tokenmill.layers.quantization.base import QuantizationConfig, QuantizeMethodBase, set_weight_attrs, weight_attr
from tokenmill.layers.quantization.unquantized import UnquantizedLinearMethod


def check_shape(loaded: torch.Tensor, expected: Sequence[int]) -> None:
    # Phrased to follow "weight <name>" in the loader's error.
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"has shape {tuple(loaded.shape)}, expected {tuple(expected)}")


def assign(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Whole tensor into the whole parameter: take it without a copy when it already fits (same dtype
    and device, and it owns exactly its storage, so no larger checkpoint buffer is kept alive)."""
    owns_storage = loaded.untyped_storage().nbytes() == loaded.numel() * loaded.element_size()
    if (param.dtype == loaded.dtype and param.device == loaded.device and loaded.is_contiguous()
            and loaded.storage_offset() == 0 and owns_storage):
        param.data = loaded
    else:
        param.data.copy_(loaded)


def stored(param: torch.Tensor, dim: int, n: int) -> int:
    """A logical size along `dim` in stored elements: packed formats keep several values per element
    (eight int4 in an int32) or one scale per group of input columns (`pack_factors` {dim: per element})."""
    factor = weight_attr(param, "pack_factors", {}).get(dim, 1)  # packed parameters only
    if n % factor:
        raise ValueError(f"cuts {n} along dim {dim}, not a multiple of its packing ({factor} per element)")
    return n // factor


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
    """Unsharded parameters (norms, replicated layers): the checkpoint tensor as is."""
    if shard_id is not None:
        raise ValueError(f"is a shard ({shard_id!r}) of a parameter that has no shards")
    check_shape(loaded_weight, param.shape)
    assign(param, loaded_weight)


class LinearBase(nn.Module):
    """y = x W^T + b over this rank's shard. `input_size`/`output_size` are the full (logical) sizes.
    `quant_method` wins; otherwise `quant_config` picks one for `prefix`; otherwise unquantized."""

    shard_ids: tuple = ()  # ids a packed layer's loader takes, in packed_modules_mapping order

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_method: QuantizeMethodBase | None = None, tp_rank: int = 0, tp_size: int = 1,
                 params_dtype: torch.dtype = torch.float32, compute_dtype: torch.dtype | None = None, *,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} is outside tp_size {tp_size}")
        self.input_size = input_size
        self.output_size = output_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.params_dtype = params_dtype
        self.compute_dtype = compute_dtype or params_dtype
        self.prefix = prefix
        if quant_method is None and quant_config is not None:
            quant_method = quant_config.get_quant_method(self, prefix)
        self.quant_method: QuantizeMethodBase = quant_method or UnquantizedLinearMethod()
        self.lora = None  # layers/lora.LoRALayer when adapters may apply to this layer (--enable-lora)

    def _create_weights(self, input_size_per_partition: int, output_partition_sizes: list[int], bias: bool,
                        bias_sharded: bool) -> None:
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = list(output_partition_sizes)
        self.output_size_per_partition = sum(output_partition_sizes)
        self.quant_method.create_weights(self, input_size_per_partition, self.output_partition_sizes,
                                         self.input_size, self.output_size, self.params_dtype,
                                         weight_loader=self.weight_loader)
        if bias:
            rows = self.output_size_per_partition if bias_sharded else self.output_size
            b = nn.Parameter(torch.zeros(rows, dtype=self.params_dtype), requires_grad=False)
            set_weight_attrs(b, {"output_dim": 0 if bias_sharded else None, "weight_loader": self.weight_loader})
            self.bias = b
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded_weight, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply(x, self.bias)

    def _apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """This rank's x W^T + b, plus the LoRA deltas of the step's adapter tokens (before any collective: a
        row-parallel layer's all-reduce sums the deltas' partials with the product's)."""
        y = self.quant_method.apply(self, x, bias)
        if self.lora is not None and self.lora.step.groups:
            y = self.lora.add_delta(x, y)
        return y

    # ---- LoRA: the full (checkpoint) shapes of each shard's A and B, and this rank's cut of them --------------
    def lora_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of each shard as a checkpoint's module has it: A is [r, in], B [out, r]."""
        return [(self.input_size, self.output_size)]

    def lora_cut(self, shard: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of one shard's (A, B): a replicated layer keeps both whole."""
        return a, b

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, "
                f"tp={self.tp_rank}/{self.tp_size}, quant={type(self.quant_method).__name__}")


class ReplicatedLinear(LinearBase):
    """The full weight on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_method: QuantizeMethodBase | None = None, tp_rank: int = 0, tp_size: int = 1,
                 params_dtype: torch.dtype = torch.float32, compute_dtype: torch.dtype | None = None, *,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__(input_size, output_size, bias, quant_method, tp_rank, tp_size, params_dtype, compute_dtype,
                         quant_config=quant_config, prefix=prefix)
        self._create_weights(input_size, [output_size], bias, bias_sharded=False)


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks: rank r holds rows [r*n, (r+1)*n) of W. With `gather_output`
    the ranks' outputs are concatenated, else each rank keeps its slice (the input of a row layer).
    `output_partition_sizes` (subclasses) gives the per-rank widths of packed parts."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False,
                 quant_method: QuantizeMethodBase | None = None, tp_rank: int = 0, tp_size: int = 1,
                 params_dtype: torch.dtype = torch.float32, compute_dtype: torch.dtype | None = None, *,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 output_partition_sizes: list[int] | None = None) -> None:
        super().__init__(input_size, output_size, bias, quant_method, tp_rank, tp_size, params_dtype, compute_dtype,
                         quant_config=quant_config, prefix=prefix)
        self.gather_output = gather_output
        if output_partition_sizes is None:
            output_partition_sizes = [_divide(output_size, tp_size, "output size")]
        self._create_weights(input_size, output_partition_sizes, bias, bias_sharded=True)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"is a shard ({shard_id!r}) of a layer that packs no shards")
        self._load_part(param, loaded_weight, 0, self.output_size_per_partition, self.output_size, self.tp_rank)

    def _load_part(self, param: torch.Tensor, loaded: torch.Tensor, offset: int, size: int, full: int,
                   shard_rank: int) -> None:
        """Rows [shard_rank*size, +size) of a `full`-row checkpoint part into rows [offset, +size) of param."""
        dim = _output_dim(param)
        offset, size, full = (stored(param, dim, n) for n in (offset, size, full))
        expected = list(param.shape)
        expected[dim] = full
        check_shape(loaded, expected)
        if size == param.shape[dim] == full:
            assign(param, loaded)
        else:
            param.data.narrow(dim, offset, size).copy_(loaded.narrow(dim, shard_rank * size, size))

    def lora_cut(self, shard: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.output_partition_sizes[shard]  # B's rows are sharded as the weight's
        return a, b.narrow(0, self._lora_rank_of(shard) * size, size)

    def _lora_rank_of(self, shard: int) -> int:
        return self.tp_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._apply(x, self.bias)
        if self.gather_output and self.tp_size > 1:
            y = collectives.all_gather_last(y, self.tp_size)
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column layers over the same input in one GEMM (gate/up). Shard ids 0, 1, ...: part i
    of every rank is part i's rank slice."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, gather_output: bool = False,
                 quant_method: QuantizeMethodBase | None = None, tp_rank: int = 0, tp_size: int = 1,
                 params_dtype: torch.dtype = torch.float32, compute_dtype: torch.dtype | None = None, *,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        parts = [_divide(s, tp_size, f"output size of part {i}") for i, s in enumerate(output_sizes)]
        super().__init__(input_size, sum(output_sizes), bias, gather_output, quant_method, tp_rank, tp_size,
                         params_dtype, compute_dtype, quant_config=quant_config, prefix=prefix,
                         output_partition_sizes=parts)
        self.output_sizes = list(output_sizes)
        self.shard_ids = tuple(range(len(output_sizes)))

    def lora_shapes(self) -> list[tuple[int, int]]:
        return [(self.input_size, n) for n in self.output_sizes]

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:  # a checkpoint that already packs the parts
            _split_full(self, param, loaded_weight, self.output_sizes)
            return
        if shard_id not in self.shard_ids:
            raise ValueError(f"has shard id {shard_id!r}; this layer's are {self.shard_ids}")
        sizes = self.output_partition_sizes
        self._load_part(param, loaded_weight, sum(sizes[:shard_id]), sizes[shard_id], self.output_sizes[shard_id],
                        self.tp_rank)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one GEMM, split by heads. When there are fewer KV heads than ranks,
    each KV head is replicated on tp_size // total_num_kv_heads ranks. Shard ids "q", "k", "v"."""

    shard_ids = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int | None = None,
                 bias: bool = False, quant_method: QuantizeMethodBase | None = None, tp_rank: int = 0,
                 tp_size: int = 1, params_dtype: torch.dtype = torch.float32,
                 compute_dtype: torch.dtype | None = None, *, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        num_heads = _divide(total_num_heads, tp_size, "number of attention heads")
        if tp_size >= total_num_kv_heads:
            num_kv_heads, replicas = 1, _divide(tp_size, total_num_kv_heads, "tensor-parallel size (over KV heads)")
        else:
            num_kv_heads, replicas = _divide(total_num_kv_heads, tp_size, "number of KV heads"), 1
        q_size, kv_size = num_heads * head_size, num_kv_heads * head_size  # this rank's widths
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size
        super().__init__(hidden_size, output_size, bias, False, quant_method, tp_rank, tp_size, params_dtype,
                         compute_dtype, quant_config=quant_config, prefix=prefix,
                         output_partition_sizes=[q_size, kv_size, kv_size])
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.num_kv_head_replicas = replicas
        self.q_size = q_size
        self.kv_size = kv_size

    def lora_shapes(self) -> list[tuple[int, int]]:
        q, kv = self.total_num_heads * self.head_size, self.total_num_kv_heads * self.head_size
        return [(self.input_size, q), (self.input_size, kv), (self.input_size, kv)]

    def _lora_rank_of(self, shard: int) -> int:
        return self.tp_rank if shard == 0 else self.tp_rank // self.num_kv_head_replicas

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
        q_full, kv_full = self.total_num_heads * self.head_size, self.total_num_kv_heads * self.head_size
        if shard_id is None:  # a checkpoint with a fused qkv tensor
            _split_full(self, param, loaded_weight, [q_full, kv_full, kv_full])
            return
        if shard_id == "q":
            self._load_part(param, loaded_weight, 0, self.q_size, q_full, self.tp_rank)
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            self._load_part(param, loaded_weight, offset, self.kv_size, kv_full,
                            self.tp_rank // self.num_kv_head_replicas)
        else:
            raise ValueError(f"has shard id {shard_id!r}; this layer's are {self.shard_ids}")


class RowParallelLinear(LinearBase):
    """Input features split over ranks: rank r holds columns [r*n, (r+1)*n) of W and computes a partial
    sum; `reduce_results` all-reduces the partials (only when tp_size > 1). The bias is added once, on
    rank 0. With `input_is_parallel=False` the layer takes the full input and slices its part."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, input_is_parallel: bool = True,
                 reduce_results: bool = True, quant_method: QuantizeMethodBase | None = None, tp_rank: int = 0,
                 tp_size: int = 1, params_dtype: torch.dtype = torch.float32,
                 compute_dtype: torch.dtype | None = None, *, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__(input_size, output_size, bias, quant_method, tp_rank, tp_size, params_dtype, compute_dtype,
                         quant_config=quant_config, prefix=prefix)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self._create_weights(_divide(input_size, tp_size, "input size"), [output_size], bias, bias_sharded=False)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
        dim = weight_attr(param, "input_dim")
        if dim is None or self.tp_size == 1:  # the bias, or nothing to cut
            default_weight_loader(param, loaded_weight, shard_id)
            return
        if shard_id is not None:
            raise ValueError(f"is a shard ({shard_id!r}) of a layer that packs no shards")
        size = param.shape[dim]
        expected = list(param.shape)
        expected[dim] = stored(param, dim, self.input_size)
        check_shape(loaded_weight, expected)
        param.data.copy_(loaded_weight.narrow(dim, self.tp_rank * size, size))

    def lora_cut(self, shard: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.input_size_per_partition  # A's columns are sharded as the weight's
        return a.narrow(1, self.tp_rank * n, n), b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._apply(x, self.bias)
        if not self.input_is_parallel:
            x = x.narrow(-1, self.tp_rank * self.input_size_per_partition, self.input_size_per_partition)
        y = self._apply(x, self.bias if self.tp_rank == 0 else None)
        if self.reduce_results:
            collectives.all_reduce(y)
        return y


def _divide(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"{what} {n} does not divide over tensor-parallel size {parts}")
    return n // parts


def _output_dim(param: torch.Tensor) -> int:
    dim = weight_attr(param, "output_dim")
    if dim is None:
        raise ValueError("has no output dimension to shard")
    return dim


def _split_full(layer: ColumnParallelLinear, param: torch.Tensor, loaded: torch.Tensor, full_sizes: list[int]) -> None:
    dim = _output_dim(param)
    expected = list(param.shape)
    expected[dim] = stored(param, dim, sum(full_sizes))
    check_shape(loaded, expected)
    offset = 0
    for shard_id, size in zip(layer.shard_ids, full_sizes):
        size = stored(param, dim, size)
        layer.weight_loader(param, loaded.narrow(dim, offset, size), shard_id)
        offset += size
