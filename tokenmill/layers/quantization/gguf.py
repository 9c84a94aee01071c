"""GGUF weights kept as the file's blocks (`--quantization gguf`, the default for .gguf files).

A linear layer whose GGUF tensor is Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K holds its weight as uint8
[output rows, bytes per row]: each row the file's blocks for that row, unchanged (GGUF's fastest dimension
is the input, so rows are contiguous). Row operations work on block rows as on float rows: llama.cpp's
Q/K row permutation is undone on them, merged layers (qkv, gate_up) concatenate them, column-parallel
shards take a range of them; a row-parallel shard cuts every row at a block boundary (ValueError if the
shard is not a whole number of blocks). The token embedding keeps its blocks too (a lookup dequantizes
only the selected rows) and a tied LM head multiplies with the same blocks.

Falls back to dequantize-at-load (the float path, as `--quantization none`): tensors of other types (Q5_0,
Q5_1, Q2_K, Q3_K, IQ*, F16, BF16, F32) and merged layers whose parts differ in type (Q4_K_M files store
some attn_v as Q6_K next to Q4_K q/k): one kernel type per layer keeps one kernel call per layer.

`apply` runs torch.ops.tokenmill.gguf_linear (tokenmill/csrc/gguf_linear.cpp) on CPU, else multiplies with
the weight dequantized by gguf's own numpy dequantizer: the reference the kernel is tested against.
"""
from __future__ import annotations

import logging
from functools import lru_cache
from collections import Counter
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.huge_pages import end_arena, to_huge_pages
from tokenmill.layers.quantization.base import (NativeLinear, QuantizationConfig, QuantizeMethodBase, layer_name,
                                                set_weight_attrs)
from tokenmill.layers.quantization.registry import QuantOptions, quantize_at_load

if TYPE_CHECKING:
    from tokenmill.model.blocks import DecoderForCausalLM

log = logging.getLogger(__name__)

# ggml type id -> name, for the types with a block kernel
KERNEL_TYPES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}

_NATIVE: bool | None = None

# Split rows: the batch-1 kernels' layout for Q4_0 / Q4_1 / Q8_0 (csrc/gguf_linear.cpp): each row's bytes
# reordered as all its blocks' f16 scales, then (Q4_1) all their f16 mins, then all their quants. Same bytes,
# same shape; the kernels read the scales 8 at a time instead of two scalar conversions per block (batch-1
# matrix-vector products ~25 % faster). Type id: SPLIT + the ggml type. TOKENMILL_GGUF_SPLIT_ROWS=0 keeps the
# file's order.
SPLIT = 1000
SPLIT_BASES = (2, 3, 8)  # Q4_0, Q4_1, Q8_0
# Interleaved rows: split Q4_0 / Q4_1 / Q8_0 rows (linear layers, embedding tables) in groups of 16, one vector
# lane per row (csrc/gguf_r16.h: the batch-1 kernels' per-row work goes, the int8 ones stream at memory speed).
# Made where the build has AVX-512 VNNI (torch.ops.tokenmill.gguf_interleaves), the rows are a multiple of 16 and
# R16 measures at least as fast as split rows for the shape on this CPU (gguf_layout.py, cached per CPU model and
# build; TOKENMILL_GGUF_INTERLEAVE=auto|1|0). Type id: R16 + the ggml type.
R16 = 2000
R16_BASES = (2, 3, 8)  # Q4_0, Q4_1, Q8_0
R16_ROWS = 16


def base_type(qtype: int) -> int:
    if qtype - SPLIT in SPLIT_BASES:
        return qtype - SPLIT
    return qtype - R16 if qtype - R16 in R16_BASES else qtype


def type_name(qtype: int) -> str:
    import gguf

    base = base_type(qtype)
    try:
        name = gguf.GGMLQuantizationType(base).name
    except ValueError:
        return f"ggml type {qtype}"
    return name + ("" if base == qtype else " (split rows)" if qtype - SPLIT == base else " (interleaved rows)")


def block_format(qtype: int) -> tuple[int, int]:
    """(weights per block, bytes per block)."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(base_type(qtype))]


def _scale_bytes(qtype: int) -> int:
    return 4 if base_type(qtype) == 3 else 2  # Q4_1: d and m; Q4_0, Q8_0: d


def split_rows(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """File-order block rows [N, row_bytes] of Q4_0 / Q4_1 / Q8_0 -> split rows (same shape)."""
    _, size = block_format(qtype)
    N = blocks.shape[0]
    b = blocks.reshape(N, -1, size)
    h = _scale_bytes(qtype)
    parts = [b[:, :, i:i + 2].reshape(N, -1) for i in range(0, h, 2)] + [b[:, :, h:].reshape(N, -1)]
    return torch.cat(parts, dim=1).contiguous()


def unsplit_rows(rows: torch.Tensor, qtype: int) -> torch.Tensor:
    """Split rows back in the file's block order (the reference dequantizer reads that)."""
    _, size = block_format(qtype)
    N, width = rows.shape
    nb = width // size
    h = _scale_bytes(qtype)
    parts = [rows[:, i * nb:(i + 2) * nb].reshape(N, nb, 2) for i in range(0, h, 2)]
    parts.append(rows[:, h * nb:].reshape(N, nb, size - h))
    return torch.cat(parts, dim=2).reshape(N, width).contiguous()


def _r16_parts(qtype: int, nb: int) -> list[tuple[int, int]]:
    """(bytes per row per block, blocks) of each part of a split row: scales, (Q4_1) mins, quants."""
    return [(2, nb)] * (_scale_bytes(qtype) // 2) + [(block_format(qtype)[1] - _scale_bytes(qtype), nb)]


@lru_cache(maxsize=16)
def _r16_order(qtype: int, width: int) -> torch.Tensor:
    """The interleaved layout, once, for one group of 16 split rows of `width` bytes: [16 * width], the flat
    split byte (r * width + j) that each interleaved byte holds. Every part [16, nb, w] goes as [nb, 16, w] (the
    quants' w bytes as w / 4 columns of 4: [nb, w / 4, 16, 4])."""
    nb = width // block_format(qtype)[1]
    g = torch.arange(R16_ROWS * width).reshape(R16_ROWS, width)
    out, at = [], 0
    for w, n in _r16_parts(qtype, nb):
        part = g[:, at:at + w * n]
        at += w * n
        if w > 2:
            out.append(part.reshape(R16_ROWS, n, w // 4, 4).permute(1, 2, 0, 3).reshape(-1))
        else:
            out.append(part.reshape(R16_ROWS, n, w).permute(1, 0, 2).reshape(-1))
    return torch.cat(out)


@lru_cache(maxsize=16)
def _r16_positions(qtype: int, width: int) -> torch.Tensor:
    """[16, width]: where split row r's byte j lies within its interleaved group (_r16_order's inverse)."""
    return torch.argsort(_r16_order(qtype, width)).reshape(R16_ROWS, width)


def interleave_rows(split: torch.Tensor, qtype: int) -> torch.Tensor:
    """Split rows [N, row_bytes] (N a multiple of 16) -> interleaved rows (same shape, _r16_order's layout)."""
    N, width = split.shape
    groups = split.reshape(N // R16_ROWS, R16_ROWS * width)
    return groups.index_select(1, _r16_order(qtype, width)).reshape(N, width)


def deinterleave_rows(rows: torch.Tensor, qtype: int) -> torch.Tensor:
    """Interleaved rows back as split rows (interleave_rows' inverse)."""
    N, width = rows.shape
    groups = rows.reshape(N // R16_ROWS, R16_ROWS * width)
    return groups.index_select(1, _r16_positions(qtype, width).reshape(-1)).reshape(N, width)


def interleaved_rows_at(rows: torch.Tensor, qtype: int, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` of an interleaved table as split rows [len(index), row_bytes] (a lookup's rows only): one
    gather of their bytes."""
    width = rows.shape[1]
    at = (index // R16_ROWS * (R16_ROWS * width)).unsqueeze(1) + _r16_positions(qtype, width)[index % R16_ROWS]
    return rows.reshape(-1)[at]


def interleaves_rows(qtype: int, rows: int, cols: int | None = None, int8_activations: bool = False) -> bool:
    """Whether a split weight of `rows` rows (of `cols` columns) of this type goes into interleaved rows here:
    the kernels are built and, unless TOKENMILL_GGUF_INTERLEAVE says, R16 measured as fast as split rows on
    this CPU for this shape and activation mode (gguf_layout.py; without `cols`: only whether it can)."""
    from tokenmill import native
    from tokenmill.layers.quantization import gguf_layout

    setting = gguf_layout.interleave_setting()
    if not (base_type(qtype) in R16_BASES and rows % R16_ROWS == 0 and rows > 0 and setting != "0"
            and native.has_op("gguf_interleaves") and torch.ops.tokenmill.gguf_interleaves()):
        return False
    if setting == "1" or cols is None:
        return True
    return gguf_layout.choose_r16(base_type(qtype), rows, cols, int8_activations)


def splits_rows() -> bool:
    import os

    return os.environ.get("TOKENMILL_GGUF_SPLIT_ROWS", "1") != "0"


def row_bytes(qtype: int, K: int) -> int:
    block, size = block_format(qtype)
    if K % block:
        raise ValueError(f"{type_name(qtype)} blocks of {block} do not divide {K} columns")
    return K // block * size


def _native_ok(x: torch.Tensor) -> bool:
    global _NATIVE
    if x.device.type != "cpu":
        return False
    if _NATIVE is None:
        from tokenmill import native

        _NATIVE = native.has_op("gguf_linear")
    return _NATIVE


def reference_dequantize(blocks: torch.Tensor, qtype: int, K: int) -> torch.Tensor:
    """float32 [N, K] by gguf's numpy dequantizer (the reference, and the path without the kernels)."""
    import gguf

    if qtype - R16 in R16_BASES:
        blocks, qtype = deinterleave_rows(blocks.detach().cpu(), qtype), qtype - R16 + SPLIT
    if base_type(qtype) != qtype:
        blocks, qtype = unsplit_rows(blocks.detach().cpu(), qtype), base_type(qtype)
    raw = blocks.detach().cpu().contiguous().numpy()
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).reshape(blocks.shape[0], K)
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(blocks.device)


def dequantize(blocks: torch.Tensor, qtype: int, K: int) -> torch.Tensor:
    """Block rows [N, row_bytes] -> float32 [N, K]."""
    if base_type(qtype) in KERNEL_TYPES and _native_ok(blocks):
        return torch.ops.tokenmill.gguf_dequantize(blocks, qtype, K)
    return reference_dequantize(blocks, qtype, K)


def gguf_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int, K: int,
                bias: torch.Tensor | None = None, int8_activations: bool = False,
                bf16_batches: bool = False) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) for W as block rows; returns x's dtype. int8_activations: a single row of x
    is quantized to int8 per 32 columns for Q4_0 / Q4_1 / Q8_0 (llama.cpp's numerics; the kernel's only).
    bf16_batches: from 32 rows, panels of W's rows dequantized into bf16 and multiplied by bf16 GEMMs (the
    kernel's only; the reference path without kernels stays float32)."""
    x2 = x.reshape(-1, K)
    if _native_ok(x2):
        y = torch.ops.tokenmill.gguf_linear(x2, blocks, qtype, K, bias, int8_activations, bf16_batches)
    else:
        y = F.linear(x2.float(), reference_dequantize(blocks, qtype, K), None if bias is None else bias.float())
    return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


def _block_loader(layer: nn.Module, qtype: int, inner: Callable | None) -> Callable:
    """The layer's own loader does the row work (merged parts, column shards); row-parallel shards are cut
    here, in bytes, at the block boundary create_weights checked."""
    from tokenmill.layers.linear import check_shape, default_weight_loader

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.dtype != torch.uint8:
            raise ValueError(f"is {loaded.dtype}; this layer keeps {type_name(qtype)} blocks (uint8 rows)")
        if getattr(layer, "input_is_parallel", None) is not None and layer.tp_size > 1:  # row-parallel layers only
            width = param.shape[1]
            check_shape(loaded, (param.shape[0], width * layer.tp_size))
            default_weight_loader(param, loaded.narrow(1, layer.tp_rank * width, width).contiguous(), shard_id)
        elif inner is not None:
            inner(param, loaded, shard_id)
        else:
            default_weight_loader(param, loaded, shard_id)

    return load


class GGUFLinearMethod(QuantizeMethodBase):
    """One ggml block type for the whole (possibly merged, possibly sharded) layer."""

    def __init__(self, qtype: int, int8_activations: bool = False, bf16_batches: bool = False) -> None:
        if qtype not in KERNEL_TYPES:
            raise ValueError(f"no GGUF block kernel for {type_name(qtype)}; kernels: {', '.join(KERNEL_TYPES.values())}")
        self.qtype = qtype
        self.int8_activations = int8_activations
        self.bf16_batches = bf16_batches

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        block, _ = block_format(self.qtype)
        if input_size_per_partition % block:
            raise ValueError(f"layer {layer_name(layer)}: its input shard of "
                             f"{input_size_per_partition} columns is not a whole number of {type_name(self.qtype)} "
                             f"blocks ({block} columns)")
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), row_bytes(self.qtype, input_size_per_partition),
                                          dtype=torch.uint8), requires_grad=False)
        inner = extra_weight_attrs.pop("weight_loader", None)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, "gguf_qtype": self.qtype,
                                  "weight_loader": _block_loader(layer, self.qtype, inner)})
        set_weight_attrs(weight, extra_weight_attrs)
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Q4_0 / Q4_1 / Q8_0 rows into the kernels' split layout, where the kernels run (after any
        tensor-parallel cut, which works on the file's blocks)."""
        if self.qtype in SPLIT_BASES and splits_rows() and _native_ok(layer.weight):
            layer.weight.data = split_rows(layer.weight.data, self.qtype)
            if interleaves_rows(self.qtype, layer.weight.shape[0], layer.input_size_per_partition,
                                self.int8_activations):
                layer.weight.data = interleave_rows(layer.weight.data, self.qtype)
                self.qtype += R16
            else:
                self.qtype += SPLIT
        if _native_ok(layer.weight):  # streamed once per decode step: in huge pages (tokenmill/huge_pages.py)
            layer.weight.data = to_huge_pages(layer.weight.data)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return gguf_matmul(x, layer.weight, self.qtype, layer.input_size_per_partition, bias, self.int8_activations,
                           self.bf16_batches)

    def native_linear(self, layer: nn.Module) -> NativeLinear | None:
        b = layer.bias
        if b is not None and b.dtype != torch.float32:
            return None
        return NativeLinear("gguf", layer.weight, b, qtype=self.qtype, K=layer.input_size_per_partition,
                            int8_activations=self.int8_activations, bf16_batches=self.bf16_batches)


def keep_embedding_blocks(module: nn.Module, qtype: int, shared: nn.Parameter | None = None,
                          int8_activations: bool = False) -> nn.Parameter:
    """Swap a VocabParallelEmbedding / ParallelLMHead's float table for block rows [vocab, row_bytes]
    (or for `shared`, a tied embedding's); the module then looks up / multiplies through the blocks."""
    from tokenmill.layers.embedding import GGUFBlockRows
    from tokenmill.layers.linear import assign, check_shape

    if shared is None:
        shape = (module.num_embeddings, row_bytes(qtype, module.embedding_dim))
        shared = nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)

        def load(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
            if shard_id is not None or loaded.dtype != torch.uint8:
                raise ValueError(f"is {loaded.dtype}; this table keeps {type_name(qtype)} blocks (uint8 rows)")
            check_shape(loaded, shape)
            assign(param, loaded)

        set_weight_attrs(shared, {"output_dim": 0, "gguf_qtype": qtype, "weight_loader": load})
    del module.weight
    module.register_parameter("weight", shared)
    # int8_activations: an LM head's logits (a lookup has no activations)
    module.table_method = GGUFBlockRows(qtype, int8_activations)
    return shared


def embedding_lookup(blocks: torch.Tensor, qtype: int, input_ids: torch.Tensor, K: int) -> torch.Tensor:
    """The selected rows' blocks (of a [vocab, row_bytes] table), gathered then dequantized: float32 [..., K]."""
    from tokenmill import native

    # An older build lacks gguf_lookup: the torch gather below.
    if base_type(qtype) in KERNEL_TYPES and _native_ok(blocks) and native.has_op("gguf_lookup"):
        return torch.ops.tokenmill.gguf_lookup(blocks, qtype, K, input_ids.reshape(-1)).reshape(*input_ids.shape, K)
    if qtype - R16 in R16_BASES:
        rows, qtype = interleaved_rows_at(blocks, qtype, input_ids.reshape(-1)), qtype - R16 + SPLIT
    else:
        rows = blocks.index_select(0, input_ids.reshape(-1))
    return dequantize(rows, qtype, K).reshape(*input_ids.shape, K)


class GGUFConfig(QuantizationConfig):
    """Knows the type of every GGUF tensor (after `bind`) and keeps the ones with a kernel as blocks."""

    name = "gguf"
    quantize_lm_head = False  # the head keeps the file's own format

    def __init__(self, int8_activations: bool = False, bf16_batches: bool = False) -> None:
        self.int8_activations = int8_activations  # --activation-quantization int8
        self.bf16_batches = bf16_batches  # --quantized-batch-dtype bfloat16
        self.types: dict[str, int] = {}  # parameter name (layers.0.self_attn.q_proj.weight) -> ggml type
        self.kept: set[str] = set()  # parameter names loaded as blocks
        self.packed: dict[str, list[str]] = {}
        self._param_name: Callable[[str], str | None] = lambda n: n

    def bind(self, path: str, cfg, model_cls) -> None:
        """Read the file's tensor types, named as `model_cls` names its parameters."""
        from tokenmill.model.gguf_loader import gguf_to_hf_names, read_gguf

        naming = model_cls.weight_naming
        self._param_name = lambda n: naming.param_name(n, tied=False)
        self.packed = dict(model_cls.packed_modules_mapping)  # (a DecoderForCausalLM subclass)
        names = gguf_to_hf_names(path, cfg)
        fallback: Counter[str] = Counter()
        for t in read_gguf(path).tensors:
            hf = names.get(t.name)
            if hf is None:
                continue
            self.types[self._param_name(hf)] = t.ggml_type
            if len(t.shape) == 2 and t.ggml_type not in KERNEL_TYPES:
                fallback[type_name(t.ggml_type)] += 1
        for kind, n in sorted(fallback.items()):
            log.info("GGUF: %d matrices of type %s have no block kernel; dequantized at load", n, kind)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        parent, _, module = prefix.rpartition(".")
        parts = self.packed.get(module, [module])
        names = [f"{parent}.{p}.weight" if parent else f"{p}.weight" for p in parts]
        types = {self.types.get(n) for n in names}
        if len(types) != 1:
            log.info("GGUF: %s merges parts of types %s; dequantized at load", prefix,
                     ", ".join(sorted(type_name(t) for t in types if t is not None)))
            return None
        qtype = types.pop()
        if qtype not in KERNEL_TYPES:
            return None
        self.kept.update(names)
        return GGUFLinearMethod(qtype, self.int8_activations, self.bf16_batches)

    def prepare_model(self, model: DecoderForCausalLM) -> None:
        """Token embedding and LM head as blocks (unsharded tables only: vocabulary-parallel ones stay float)."""
        embed, head = model.embed_tokens, model.lm_head  # (None on pipeline stages without them)
        tied = model.tie_word_embeddings
        shared = None
        qtype = self.types.get("embed_tokens.weight")
        if embed is not None and embed.tp_size == 1 and qtype in KERNEL_TYPES:
            shared = keep_embedding_blocks(embed, qtype)  # a lookup: no activations
            self.kept.add("embed_tokens.weight")
            if tied and head is not None:
                keep_embedding_blocks(head, qtype, shared, self.int8_activations)
        qtype = self.types.get("lm_head.weight")
        if head is not None and not tied and head.tp_size == 1 and qtype in KERNEL_TYPES:
            keep_embedding_blocks(head, qtype, int8_activations=self.int8_activations)
            self.kept.add("lm_head.weight")

    def finish_model(self, model: DecoderForCausalLM) -> None:
        """Once loaded: the token embedding's and LM head's Q4_0 / Q4_1 / Q8_0 tables into split rows (a tied
        table once, for both), where the kernels run, interleaved by 16 where those kernels are built. Their
        lookups take back only the rows they read."""
        import dataclasses

        from tokenmill.layers.embedding import GGUFBlockRows

        done: set[int] = set()
        for module in (model.embed_tokens, model.lm_head):
            method = module.table_method if module is not None else None
            if not isinstance(method, GGUFBlockRows) or method.qtype not in SPLIT_BASES or not splits_rows() \
                    or not _native_ok(module.weight):
                continue
            form = SPLIT
            if interleaves_rows(method.qtype, module.weight.shape[0], module.embedding_dim, self.int8_activations):
                form = R16
            if id(module.weight) not in done:
                rows = split_rows(module.weight.data, method.qtype)
                module.weight.data = to_huge_pages(interleave_rows(rows, method.qtype) if form == R16 else rows)
                done.add(id(module.weight))
            module.table_method = dataclasses.replace(method, qtype=method.qtype + form)
        end_arena()  # this model's smaller weights are placed: the next model starts an arena of its own

    def keeps_blocks(self, checkpoint_name: str) -> bool:
        """Whether the loader hands this tensor (transformers' name) over as raw block rows."""
        return self._param_name(checkpoint_name) in self.kept


@quantize_at_load("gguf")
def gguf_config(options: QuantOptions) -> GGUFConfig:
    # blocks have their own group size
    return GGUFConfig(int8_activations=options.int8_activations, bf16_batches=options.bf16_batches)
