"""The worker's KV pool sizing: a flag's block count or byte budget, a share of available memory on CPU, and on
CUDA what is left after profiling the most a step can hold; checked against one full-length request.
Mixed into Worker."""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache import blocks_for_tokens

if TYPE_CHECKING:
    from tokenmill.executor.model_runner import ModelRunner

# The worker's log: its start-up lines keep one name whichever stage writes them.
log = logging.getLogger("tokenmill.executor.worker")

GiB = 1 << 30
# On CPU with no explicit budget, the KV pool takes this share of available memory, at most
# DEFAULT_CPU_KV_BYTES (vLLM's CPU default, VLLM_CPU_KVCACHE_SPACE=4 GiB). Pages are touched only when a
# block is first used, so a large pool costs nothing until requests fill it.
DEFAULT_CPU_KV_BYTES = 4 * GiB


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def kv_dtype_for(name: str, model: torch.nn.Module) -> torch.dtype:
    from tokenmill.layers.attention_backends.kv_quant import QUANT_KV_DTYPES
    from tokenmill.platform import parse_dtype

    if name in QUANT_KV_DTYPES:
        return QUANT_KV_DTYPES[name]
    dtype = parse_dtype(name)
    if dtype is not None:
        return dtype
    storage = getattr(model, "storage_dtype", None)  # "auto": the weights' storage dtype (DecoderForCausalLM sets it)
    return storage if storage is not None else next(model.parameters()).dtype


def min_blocks(max_model_len: int, num_lookahead_tokens: int, block_size: int,
               group_windows: tuple[int | None, ...] = (None,), chunk: int = 1) -> int:
    """The smallest KV pool that runs one request to max_model_len. Every allocation reserves
    num_lookahead_tokens slots past the request's tokens for speculative drafts (core/kv_cache.py
    allocate_slots), so a full-length request with speculation needs that many more slots; a windowed KV
    cache group holds only its window and the chunk being computed (`chunk`: the longest one). Several
    running requests need not all fit at once: the scheduler preempts to make room."""
    return blocks_for_tokens(max_model_len + num_lookahead_tokens, group_windows, block_size, chunk)


class KVSizing:
    """Mixed into Worker; reads its config, runner, device and parallel layout."""

    runner: ModelRunner
    config: EngineConfig
    device: torch.device
    world_size: int
    cpu_group: object | None
    cp_size: int
    max_model_len: int
    kv_group_windows: tuple[int | None, ...]
    _cuda_used_by_others: int

    def determine_num_blocks(self, kv_dtype: torch.dtype) -> int:
        """CPU: the byte budget given, else a share of available memory. CUDA: what is left of
        gpu_memory_utilization x total memory after the weights and a profiling forward pass."""
        cache, per_block = self.config.cache, self.runner.block_bytes(kv_dtype)
        if cache.num_gpu_blocks_override is not None:
            num_blocks, source = cache.num_gpu_blocks_override, "num_gpu_blocks_override"
        elif cache.kv_cache_memory_bytes is not None:
            num_blocks, source = cache.kv_cache_memory_bytes // per_block, "kv_cache_memory_bytes"
        elif self.device.type == "cuda":
            num_blocks, source = self._profile_cuda_blocks(kv_dtype, per_block), "gpu_memory_utilization"
        else:
            budget = min(DEFAULT_CPU_KV_BYTES, int(available_memory_bytes() * cache.kv_cache_memory_fraction))
            num_blocks, source = budget // per_block, "kv_cache_memory_fraction"
        if self.world_size > 1:  # every rank holds the same blocks: the smallest pool decides
            import torch.distributed as dist

            n = torch.tensor([num_blocks], dtype=torch.long)  # a CPU tensor: over the gloo control group
            dist.all_reduce(n, op=dist.ReduceOp.MIN, group=self.cpu_group)
            num_blocks = int(n)
        lookahead = self.config.scheduler.num_lookahead_tokens
        need = min_blocks(self.max_model_len, lookahead, cache.block_size, self.kv_group_windows,
                          self.config.scheduler.max_num_batched_tokens + lookahead)
        if num_blocks * self.cp_size < need:  # (context parallelism: the ranks' blocks together)
            spec = f" plus {lookahead} speculative lookahead slots" if lookahead else ""
            groups = len(self.kv_group_windows)
            held = (f"{num_blocks * cache.block_size} tokens" if groups == 1 else
                    f"blocks shared by {groups} KV cache groups: a request holds its context in the full-attention "
                    "ones and a window and a prompt chunk in the others")
            others = ""
            if source == "gpu_memory_utilization" and self._cuda_used_by_others > 2**30:
                others = (f" {self._cuda_used_by_others / GiB:.1f} GiB of the device is held outside this engine (other "
                          "processes, or an earlier engine in this one that was not closed: LLM.close()).")
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {cache.block_size} tokens ({held}), fewer than one request "
                f"of max_model_len={self.max_model_len} tokens{spec} needs ({need} blocks, {need * per_block} bytes). "
                f"Raise {source} or lower max_model_len.{others}"
            )
        return num_blocks

    def _profile_cuda_blocks(self, kv_dtype: torch.dtype, per_block: int) -> int:
        """vLLM's recipe, counting everything a step holds: run the dummy steps of executor/profile_steps.py (the
        most prompt tokens over the most requests, every one sampled with the most logprobs and prompt logprobs,
        then k drafts verified for each under a grammar bitmask) on a throw-away pool, take the peak memory, and
        give the KV pool what is left of gpu_memory_utilization x total."""
        from tokenmill.executor.profile_steps import profile_steps

        sched, spec = self.config.scheduler, self.config.speculative
        steps, blocks = profile_steps(min(sched.max_num_batched_tokens, self.max_model_len), sched.max_num_seqs,
                                      self.max_model_len, self.config.cache.block_size, self.runner.vocab_size,
                                      len(self.kv_group_windows), spec.num_speculative_tokens if spec else 0)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.runner.allocate_kv_cache(blocks, kv_dtype)
        for batch in steps:
            self.runner.execute_model(batch)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - blocks * per_block
        graphs = self._graph_bytes() if self.runner.graph_mode is not None else 0
        for a in self.runner.attn_layers:
            a.k_cache = a.v_cache = a.k_scale_cache = a.v_scale_cache = None
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        self._cuda_used_by_others = used_by_others
        budget = int(total * self.config.cache.gpu_memory_utilization) - peak - graphs - used_by_others
        if graphs:
            budget -= per_block  # the graphs' pad block, allocated past the pool
        log.info("CUDA memory: %.2f GiB total, peak of the profiling steps (%d tokens, %d sampled requests) %.2f GiB, "
                 "CUDA graphs %.2f GiB, %.2f GiB for the KV cache", total / GiB, steps[0].num_tokens, len(steps[0]),
                 peak / GiB, graphs / GiB, max(budget, 0) / GiB)
        return max(budget, 0) // per_block
