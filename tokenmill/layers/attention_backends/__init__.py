"""Attention backends; importing the package registers the built-in ones."""
from tokenmill.layers.attention_backends.base import AttentionBackend, BatchLayout
from tokenmill.layers.attention_backends.registry import available_backends, get_attention_backend, register_backend
from tokenmill.layers.attention_backends import torch_sdpa  # noqa: F401  (registers torch_sdpa)

__all__ = ["AttentionBackend", "BatchLayout", "available_backends", "get_attention_backend", "register_backend"]
