"""Token embedding and LM head, with the vocabulary split over tensor-parallel ranks.

Rank r holds rows [r*n, (r+1)*n) of the [vocab, hidden] table, n = ceil(vocab / tp_size); the last
rank's rows past the vocabulary are zero padding."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import collectives
from tokenmill.layers.linear import assign, check_shape
from tokenmill.layers.quantization.base import set_weight_attrs


class EmbeddingMethod(ABC):
    """How a vocabulary table is stored and used, as a quant method is for a linear layer: the module holds
    the tensors (parameters, so weight counts and tying see them), its `table_method` says how to read them.
    A format that keeps the table packed swaps the module's tensors and sets its own method."""

    int8_activations: bool = False  # an LM head's logits from int8-quantized hidden states at batch 1

    @abstractmethod
    def lookup(self, module: "VocabParallelEmbedding", input_ids: torch.Tensor) -> torch.Tensor:
        """The rows of `input_ids`: [..., hidden]."""

    @abstractmethod
    def logits(self, module: "ParallelLMHead", hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] @ table^T: float32 logits over the whole vocabulary."""


@dataclass(frozen=True)
class FloatTable(EmbeddingMethod):
    """`weight` [rows of this rank, hidden] in the load dtype; the only method for a vocabulary-parallel table."""

    def lookup(self, module: "VocabParallelEmbedding", input_ids: torch.Tensor) -> torch.Tensor:
        if module.tp_size == 1:
            return F.embedding(input_ids, module.weight)
        # Ids of other ranks look up row 0 and are zeroed; the all-reduce fills them in.
        mine = (input_ids >= module.vocab_start) & (input_ids < module.vocab_end)
        out = F.embedding(torch.where(mine, input_ids - module.vocab_start, 0), module.weight)
        out = out.masked_fill(~mine.unsqueeze(-1), 0)
        collectives.all_reduce(out)
        return out

    def logits(self, module: "ParallelLMHead", hidden: torch.Tensor) -> torch.Tensor:
        from tokenmill.layers.quantization.unquantized import dense_matmul

        # Same numerics as a dense head: the product in the hidden states' dtype (the native dense_linear for
        # float32 rows on the CPU, as the linear layers), then float32.
        logits = dense_matmul(hidden, module.weight)
        if module.tp_size > 1:
            logits = collectives.all_gather_last(logits, module.tp_size)[..., : module.num_embeddings]
        return logits.float()


@dataclass(frozen=True)
class PackedFloatHead(FloatTable):
    """An LM head whose table is also (tied) or only (untied) held packed for oneDNN as `packed_weight`
    (ParallelLMHead.pack_for_onednn): bf16/fp16 logits without oneDNN's per-call reorder of the table."""

    def logits(self, module: "ParallelLMHead", hidden: torch.Tensor) -> torch.Tensor:
        from tokenmill.layers.quantization.onednn_pack import packed_linear

        return packed_linear(hidden, module.packed_weight).float()


@dataclass(frozen=True)
class Int8Rows(EmbeddingMethod):
    """`qweight` int8 [vocab, hidden] with a float32 `scale` per row (ParallelLMHead.quantize_int8)."""

    int8_activations: bool = False
    per_token: bool = False  # int8_per_token: W8A8 logits (weight_only.int8_per_token_matmul)

    def lookup(self, module: "VocabParallelEmbedding", input_ids: torch.Tensor) -> torch.Tensor:
        return module.qweight[input_ids].float() * module.scale[input_ids].unsqueeze(-1)

    def logits(self, module: "ParallelLMHead", hidden: torch.Tensor) -> torch.Tensor:
        from tokenmill.layers.quantization.weight_only import int8_matmul

        return int8_matmul(hidden, module.qweight, module.scale, int8_activations=self.int8_activations,
                           per_token=self.per_token).float()


@dataclass(frozen=True)
class GGUFBlockRows(EmbeddingMethod):
    """`weight` uint8 [vocab, row_bytes]: a GGUF file's blocks of type `qtype` (quantization/gguf.py's
    keep_embedding_blocks); a lookup dequantizes only the selected rows."""

    qtype: int
    int8_activations: bool = False

    def lookup(self, module: "VocabParallelEmbedding", input_ids: torch.Tensor) -> torch.Tensor:
        from tokenmill.layers.quantization.gguf import embedding_lookup

        return embedding_lookup(module.weight, self.qtype, input_ids, module.embedding_dim)

    def logits(self, module: "ParallelLMHead", hidden: torch.Tensor) -> torch.Tensor:
        from tokenmill.layers.quantization.gguf import gguf_matmul

        return gguf_matmul(hidden, module.weight, self.qtype, module.embedding_dim,
                           int8_activations=self.int8_activations).float()


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype = torch.float32,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} is outside tp_size {tp_size}")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        per_rank = -(-num_embeddings // tp_size)
        self.num_embeddings_per_partition = per_rank
        self.vocab_start = min(tp_rank * per_rank, num_embeddings)
        self.vocab_end = min(self.vocab_start + per_rank, num_embeddings)
        # Filled by the checkpoint; a shard's rows past the vocabulary stay zero.
        make = torch.empty if tp_size == 1 else torch.zeros
        self.weight = nn.Parameter(make(per_rank, embedding_dim, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(self.weight, {"output_dim": 0, "weight_loader": self.weight_loader})
        self.table_method: EmbeddingMethod = FloatTable()

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"is a shard ({shard_id!r}) of an embedding, which packs none")
        check_shape(loaded_weight, (self.num_embeddings, self.embedding_dim))
        if self.tp_size == 1:
            assign(param, loaded_weight)
            return
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(loaded_weight[self.vocab_start : self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.table_method.lookup(self, input_ids)

    @property
    def int8_activations(self) -> bool:
        return self.table_method.int8_activations

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_rank}/{self.tp_size}"


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> float32 logits over the whole vocabulary (every rank gets all of them)."""

    def tie_weights(self, embedding: VocabParallelEmbedding) -> "ParallelLMHead":
        """Share the embedding table (tie_word_embeddings): one parameter, loaded once."""
        if (embedding.num_embeddings, embedding.embedding_dim, embedding.tp_size) != \
                (self.num_embeddings, self.embedding_dim, self.tp_size):
            raise ValueError("cannot tie an LM head to an embedding of another shape or sharding")
        self.weight = embedding.weight
        return self

    def quantize_int8(self, tied: VocabParallelEmbedding | None = None, int8_activations: bool = False,
                      per_token: bool = False) -> None:
        """Keep the head as int8 rows with a scale each (`--quantization`): at batch 1 the head is the largest
        matrix read per token (SmolLM2: 113 of 513 MB in float32). A tied embedding looks its rows up in the
        same int8 table, so the float table is freed."""
        from tokenmill.layers.quantization.weight_only import quantize_int8

        if self.tp_size != 1:
            return  # sharded heads stay float until tensor parallelism quantizes them
        q, scale = quantize_int8(self.weight.data)
        for module in (self, tied) if tied is not None else (self,):
            del module.weight
            module.register_parameter("qweight", nn.Parameter(q, requires_grad=False))
            module.register_parameter("scale", nn.Parameter(scale, requires_grad=False))
        if tied is not None:
            tied.qweight, tied.scale = self.qweight, self.scale  # one table, not two copies
            tied.table_method = Int8Rows()  # a lookup has no activations
        self.table_method = Int8Rows(int8_activations, per_token)

    def pack_for_onednn(self, tied: bool) -> None:
        """Hold the float table packed for oneDNN's GEMM (layers/quantization/onednn_pack.py) where it multiplies
        this dtype natively. A tied table stays plain too, for the embedding's row lookups (a second copy of
        the table: the head is the largest matrix of a small model's step); an untied one is replaced.
        Nothing is done for other tables, sharded heads, or with packing off."""
        from tokenmill.layers.quantization import onednn_pack

        if self.tp_size != 1 or type(self.table_method) is not FloatTable or not onednn_pack.packable(self.weight):
            return
        self.register_parameter("packed_weight",
                                nn.Parameter(onednn_pack.pack(self.weight.data), requires_grad=False))
        if not tied:
            del self.weight
        self.table_method = PackedFloatHead()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.table_method.logits(self, hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not an embedding lookup; call compute_logits")
