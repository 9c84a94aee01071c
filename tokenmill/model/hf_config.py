"""Reading transformers configs, whose keys vary by model type and transformers version (a Qwen2MoeConfig has
`decoder_sparse_step`, a Gemma3TextConfig `query_pre_attn_scalar`, newer versions `rope_parameters` where older
ones had `rope_theta`): the optional ones are read through `hf_get`, with the default the model family assumes."""
from __future__ import annotations

from typing import Any


def hf_get(cfg: Any, key: str, default: Any = None) -> Any:
    """cfg.key, or `default` where this config class (or transformers version) has no such key."""
    return getattr(cfg, key, default)  # getattr: transformers PretrainedConfig subclasses; their keys vary
