"""Engine configuration: plain dataclasses, no torch."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    model: str | None = None  # None: the embedded default model
    tokenizer: str | None = None
    dtype: str = "auto"  # storage dtype of weights: auto | float32 | bfloat16 | float16
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0
    trust_remote_code: bool = False


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # None: a fraction of free RAM on CPU
    num_gpu_blocks_override: int | None = None  # vLLM's name: explicit number of KV blocks
    enable_prefix_caching: bool = True
    kv_cache_memory_fraction: float = 0.25  # of available RAM when no byte budget is given
    # KV offloading: evicted prefix blocks go to host memory, then (past its budget) to files on disk.
    kv_offload_bytes: int = 0  # host tier budget; 0 with no dir: off
    kv_offload_dir: str | None = None  # disk tier: a folder for block files (a subfolder per engine)
    kv_offload_disk_bytes: int | None = None  # disk tier budget; None: unbounded
    kv_offload_group_blocks: int = 8  # blocks per disk file
    kv_offload_min_blocks: int | None = None  # shortest chain worth loading; None: measured at start-up


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    policy: str = "fcfs"  # fcfs | priority


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = "cpu"

    def validate(self) -> None:
        if self.cache.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.cache.block_size}.")
        if self.scheduler.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.scheduler.max_num_seqs}.")
        if self.scheduler.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.scheduler.max_num_batched_tokens}."
            )
        if self.cache.kv_offload_bytes < 0:
            raise ValueError(f"kv_offload_bytes must not be negative, got {self.cache.kv_offload_bytes}.")
        if (self.cache.kv_offload_bytes or self.cache.kv_offload_dir) and not self.cache.enable_prefix_caching:
            raise ValueError("kv_offload_bytes / kv_offload_dir need prefix caching (enable_prefix_caching=True).")
        if self.scheduler.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {self.scheduler.policy!r}.")
