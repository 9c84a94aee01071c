"""The typed contract between a model family and the GGUF loader (model/gguf_loader.py): what one of llama.cpp's
`general.architecture` names means to tokenmill. A family declares its `GGUFArch` next to its model class
(`registry.register_gguf`), so adding an architecture edits no central table.

The loader builds the config keywords every llama.cpp architecture shares (sizes, heads, rope theta and scaling,
norm epsilon, tied embeddings, special tokens) and hands them to the family's `config` hook for the keys only that
family has; it names tensors with gguf-py's map for the architecture (plus `extra_parts`) or the family's own
`tensor_names`; and a family's `joiner` puts back tensors llama.cpp's converter split or transposed.
This module imports nothing heavy: every family module imports it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import numpy as np

    from tokenmill.model.gguf_file import GGUFFile, TensorInfo


@dataclass(frozen=True)
class GGUFMeta:
    """A GGUF file's metadata as a family's config hook reads it: `meta(key)` is `<arch>.<key>`."""

    arch: str
    fields: dict[str, Any]
    tensors: dict[str, TensorInfo]
    reader: GGUFFile  # for metadata stored as tensors (Phi-3's LongRoPE factors)

    def __call__(self, key: str, default: Any = None) -> Any:
        return self.fields.get(f"{self.arch}.{key}", default)

    def expert_count(self) -> int:
        return int(self("expert_count", 0) or 0)


@dataclass(frozen=True)
class GGUFConfig:
    """A transformers config to build: its class (by name: transformers is imported only when a file loads), the
    config.json `architectures` entry the registry resolves to a model class, and the class's keyword arguments."""

    config_class: str
    architecture: str
    kwargs: dict[str, Any]

    def updated(self, **kwargs: Any) -> GGUFConfig:
        return replace(self, kwargs={**self.kwargs, **kwargs})


class TensorJoiner:
    """Puts back, as the file's tensors stream past, what llama.cpp's converter split or transposed. One instance a
    load (it holds halves until their pair arrives); the base class passes every tensor through unchanged."""

    def take_raw(self, hf: str, ggml_type: int, raw: np.ndarray,
                 shape: tuple[int, ...]) -> list[tuple[str, np.ndarray]] | None:
        """The tensors to load from a tensor's file bytes as they are (not dequantized), or None to go on as usual
        (gpt-oss keeps MXFP4 experts so)."""
        return None

    def add(self, gguf_name: str, hf: str, w: np.ndarray) -> list[tuple[str, np.ndarray]]:
        """The (transformers name, float array) pairs a dequantized tensor becomes: none while it waits for its
        other half, then the joined tensor."""
        return [(hf, w)]

    def check_done(self, path: str) -> None:
        """Raise ValueError naming a tensor left without its other half."""


ConfigHook = Callable[[GGUFMeta, GGUFConfig], GGUFConfig]


@dataclass(frozen=True)
class GGUFArch:
    """One llama.cpp architecture as tokenmill loads it."""

    name: str  # general.architecture, as llama.cpp spells it
    config_class: str  # the transformers config class name
    architecture: str  # the config.json "architectures" entry it loads as
    permuted_qk: bool = False  # llama.cpp permuted the Q/K rows for its rope layout: undone at load
    norm_plus_one: bool = False  # (1 + w) norms stored with the 1 added: subtracted at load
    # rotary covers part of each head: the head size is key_length or hidden / heads, never rope.dimension_count
    # (the rotated features)
    partial_rope: bool = False
    # its config hook reads LongRoPE's rope_factors_long / _short tensors; the loader refuses them for the others
    longrope: bool = False
    # the family's own metadata keys: takes the generic config (config_class, architecture and the shared keys),
    # returns the one to build (another class for a variant: Mixtral written as llama, DeepSeek-V3 as deepseek2)
    config: ConfigHook | None = None
    # GGUF block part -> transformers part, over gguf-py's map, where that map is ambiguous for the family
    extra_parts: dict[str, str] = field(default_factory=dict)
    # the whole GGUF -> transformers tensor-name map for a layer count, instead of gguf-py's map
    tensor_names: Callable[[int], dict[str, str]] | None = None
    # (transformers config, whether blocks may be kept) -> a fresh joiner for one load
    joiner: Callable[[Any, bool], TensorJoiner] | None = None


def head_dim_of(kwargs: dict[str, Any]) -> int:
    """The head size the generic keywords give (head_dim, else hidden / heads)."""
    return int(kwargs.get("head_dim") or kwargs["hidden_size"] // kwargs["num_attention_heads"])


def partial_rope_kwargs(meta: GGUFMeta, kwargs: dict[str, Any], default_rope_dim: int,
                        rope_extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Config keys of a partial-rotary family (Phi-3, GLM-4): `rope.dimension_count` rotated features of each
    head (`default_rope_dim` when absent), as `partial_rotary_factor` in rope_parameters and beside it;
    `rope_extra` joins rope_parameters (Phi-3's LongRoPE)."""
    factor = int(meta("rope.dimension_count") or default_rope_dim) / head_dim_of(kwargs)
    rope = dict(kwargs["rope_parameters"], partial_rotary_factor=factor, **(rope_extra or {}))
    out = dict(rope_parameters=rope, partial_rotary_factor=factor)
    if "original_max_position_embeddings" in rope:
        out["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    return out
