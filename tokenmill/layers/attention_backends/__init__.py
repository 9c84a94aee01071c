"""Attention backends; importing the package registers the built-in ones."""
from tokenmill.layers.attention_backends.base import AttentionBackend, BatchLayout
from tokenmill.layers.attention_backends.registry import (available_backends, default_backend, get_attention_backend,
                                                          register_backend)
from tokenmill.layers.attention_backends import cpu_paged, torch_sdpa, triton_paged  # noqa: F401  (registers them)

__all__ = ["AttentionBackend", "BatchLayout", "available_backends", "default_backend", "get_attention_backend", "register_backend"]
