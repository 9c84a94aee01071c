"""Turns a scheduled batch into tensors, runs one forward pass, returns the logits the sampler needs."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from tokenmill.config import CacheConfig
from tokenmill.core.request import Request
from tokenmill.layers.attention import Attention
from tokenmill.layers.attention_backends.base import BatchLayout
from tokenmill.layers.attention_backends.torch_sdpa import TorchSDPABackend

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 4 << 30  # like vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE=4 GiB)


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [num sampled requests, V] float32, in `sample_requests` order
    sample_requests: list[Request]
    prompt_logits: dict[int, tuple[torch.Tensor, int]]  # id(req) -> (logits of chunk positions [n, V], first position)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: CacheConfig, max_model_len: int, device: str = "cpu") -> None:
        self.model = model
        self.device = torch.device(device)
        self.block_size = cache.block_size
        self.max_model_len = max_model_len
        self.backend = TorchSDPABackend()
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        kv_dtype = next(model.parameters()).dtype
        self.kv_dtype = kv_dtype
        per_block = sum(2 * self.block_size * a.num_kv_heads * a.head_dim for a in self.attn_layers) * kv_dtype.itemsize
        self.bytes_per_block = per_block
        if cache.num_gpu_blocks_override is not None:
            num_blocks = cache.num_gpu_blocks_override
            source = "num_gpu_blocks_override"
        else:
            budget = cache.kv_cache_memory_bytes
            if budget is None:
                budget = min(DEFAULT_CPU_KV_BYTES, int(available_memory_bytes() * cache.kv_cache_memory_fraction))
            num_blocks = budget // per_block
            source = "kv_cache_memory_bytes"
        need = -(-max_model_len // self.block_size)
        if num_blocks < need:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {self.block_size} tokens ({num_blocks * self.block_size} tokens), "
                f"fewer than one request of max_model_len={max_model_len} tokens needs ({need} blocks, "
                f"{need * per_block} bytes). Raise {source} or lower max_model_len."
            )
        self.num_blocks = num_blocks
        self.zeroed_blocks = 0  # blocks [0, zeroed_blocks) have been zeroed
        for a in self.attn_layers:
            shape = (num_blocks, self.block_size, a.num_kv_heads, a.head_dim)
            # Not zeroed here (4 GiB of memset takes seconds): each block is zeroed on first use.
            a.k_cache = torch.empty(shape, dtype=kv_dtype, device=self.device)
            a.v_cache = torch.empty(shape, dtype=kv_dtype, device=self.device)
            a.backend = self.backend
        log.info("KV cache: %d blocks x %d tokens, %.1f MiB", num_blocks, self.block_size, num_blocks * per_block / 2**20)

    def _zero_new_blocks(self, upto: int) -> None:
        """Unwritten slots are read (and masked) by attention; NaN garbage there would survive the
        mask, so zero blocks before first use. The pool hands out never-used blocks in id order."""
        if upto <= self.zeroed_blocks:
            return
        for a in self.attn_layers:
            a.k_cache[self.zeroed_blocks : upto].zero_()
            a.v_cache[self.zeroed_blocks : upto].zero_()
        self.zeroed_blocks = upto

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]]) -> ForwardOutput:
        t_start = time.perf_counter()
        ids: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        prompt_rows: list[tuple[Request, int, int, int]] = []  # (req, first packed row, rows, first position)
        offset = 0
        for req, n in scheduled:
            start = req.num_computed_tokens
            ids.extend(req.token_ids[start : start + n])
            starts.append(start)
            lens.append(n)
            tables.append(req.block_ids)
            if start + n == req.num_tokens:
                sample_rows.append(offset + n - 1)
                sample_reqs.append(req)
            if req.params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                rows = min(n, req.num_prompt_tokens - 1 - start)
                prompt_rows.append((req, offset, rows, start))
            offset += n

        T = offset
        # For the roofline: keys each new token attends to (causal pairs) and KV tokens read.
        self.last_attn_pairs = sum(n * st + n * (n + 1) // 2 for st, n in zip(starts, lens))
        self.last_kv_tokens = sum(st + n for st, n in zip(starts, lens))
        q_len = torch.tensor(lens, dtype=torch.long)
        start_pos = torch.tensor(starts, dtype=torch.long)
        q_start = torch.cumsum(q_len, 0) - q_len
        req_idx = torch.repeat_interleave(torch.arange(len(lens)), q_len)
        positions = torch.arange(T) - q_start[req_idx] + start_pos[req_idx]
        max_nb = max(len(t) for t in tables)
        table = torch.zeros(len(tables), max_nb, dtype=torch.long)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        bs = self.block_size
        self._zero_new_blocks(int(table.max()) + 1)
        slots = table[req_idx, positions // bs] * bs + positions % bs
        layout = BatchLayout(
            query_start=q_start, query_len=q_len, kv_len=start_pos + q_len, block_tables=tables,
            slot_mapping=slots, num_tokens=T,
        )
        meta = self.backend.build_metadata(layout, bs, self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        t_prepared = time.perf_counter()
        hidden = self.model(input_ids, positions.to(self.device), meta)

        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, dtype=torch.long, device=self.device)])
        prompt_logits = {}
        for req, row, rows, first_pos in prompt_rows:
            prompt_logits[id(req)] = (self.model.compute_logits(hidden[row : row + rows]), first_pos)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.last_prepare_s = t_prepared - t_start
        self.last_forward_s = time.perf_counter() - t_prepared
        return ForwardOutput(logits=logits, sample_requests=sample_reqs, prompt_logits=prompt_logits)
