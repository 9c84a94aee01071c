"""What an attention backend gets from the model runner, once per step."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BatchLayout:
    """The packed batch as the runner builds it (request order; prompt chunks and decodes mixed)."""

    query_start: torch.Tensor  # [B] offset of each request's first new token in the packed batch
    query_len: torch.Tensor  # [B] new tokens per request
    kv_len: torch.Tensor  # [B] tokens in the cache after this step (cached prefix + new)
    block_tables: list[list[int]]  # per request
    slot_mapping: torch.Tensor  # [T] cache slot of each new token (block * block_size + offset)
    num_tokens: int


class AttentionBackend:
    name = "base"

    def build_metadata(self, layout: BatchLayout, block_size: int, device: torch.device):
        raise NotImplementedError

    def forward(self, q, k_cache, v_cache, meta, sliding_window: int | None, scale: float) -> torch.Tensor:
        raise NotImplementedError
