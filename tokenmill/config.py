"""Engine configuration: plain dataclasses, no torch. `EngineArgs` (engine_args.py) fills them."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.sampling_params import POOLING_TYPES  # embeddings: sampling_params.PoolingParams, executor/pooling.py

DTYPES = ("auto", "float32", "bfloat16", "float16")
# KV cache: the float dtypes, or quantized (vLLM names; fp8 = fp8_e4m3), see attention_backends/kv_quant.py.
KV_CACHE_DTYPES = DTYPES + ("int8", "fp8", "fp8_e4m3")
SCHEDULING_POLICIES = ("fcfs", "priority", "slo")  # core/policies registers one of each
ACTIVATION_QUANTIZATIONS = ("none", "int8", "int8_per_token")
QUANTIZED_BATCH_DTYPES = ("float32", "bfloat16")
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
# Speculative decoding proposers (vLLM's names; "deepseek_mtp" is taken as "mtp").
SPEC_METHODS = ("ngram", "draft_model", "quantized_self", "eagle", "eagle3", "mtp", "medusa", "dflash")


@dataclass
class ModelConfig:
    model: str | None = None  # None: the embedded default model
    tokenizer: str | None = None
    # Hugging Face ids (model/hub.py): the branch, tag or commit of the model's repository, and the cache folder
    # (None: HF_HUB_CACHE, else HF_HOME/hub)
    revision: str | None = None
    download_dir: str | None = None
    dtype: str = "auto"  # storage dtype of weights: auto | float32 | bfloat16 | float16
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0
    trust_remote_code: bool = False
    quantization: str | None = None  # int8 | int4: quantize at load; gptq | awq | fp8: pre-quantized checkpoint
    quantization_group_size: int = 32  # int4: input columns per scale/zero (32, 64, 128)
    # int8: the kernels of packed weights (GGUF Q4_0/Q4_1/Q8_0, int4, int8) quantize each row of x to int8 per
    # 32 columns, as llama.cpp; int8_per_token: int8 weights take one scale per row and torch._int_mm (W8A8,
    # vLLM's dynamic per-token), the others as int8; none: float32 activations (exact against transformers)
    activation_quantization: str = "none"
    # bfloat16: batches of 32+ rows through GGUF block weights dequantize panels of weight rows into bf16 and run
    # bf16 GEMMs (AMX / AVX-512 BF16 through oneDNN); float32 (default): float panels and SGEMM, exact
    quantized_batch_dtype: str = "float32"
    # CPU: keep at most this many GiB of weights in memory and stream the other decoder layers from a file on
    # disk each step (model/weight_store.py); None: every weight resident
    weights_resident_gb: float | None = None
    weights_stream_dir: str | None = None  # where the stream file goes (default: the system's temporary folder)
    # GPU: keep this many GiB of the weights in (pinned) host memory, copied to the device layer by layer each
    # step on a side stream (model/host_offload.py; vLLM's --cpu-offload-gb); 0: every weight on the device
    cpu_offload_gb: float = 0.0
    # Embedding requests (LLM.embed, /v1/embeddings): the final hidden state of the prompt's last token, or the mean
    # over every prompt token (a request may choose its own).
    pooling: str = "last"


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # auto: the weights' storage dtype; int8 | fp8 | fp8_e4m3: quantized
    kv_cache_memory_bytes: int | None = None  # None: sized from free memory (the two fractions below)
    num_gpu_blocks_override: int | None = None  # vLLM's name: explicit number of KV blocks
    enable_prefix_caching: bool = True
    kv_cache_memory_fraction: float = 0.25  # CPU: of available RAM when no byte budget is given
    gpu_memory_utilization: float = 0.9  # CUDA: of device memory for weights + activations + KV, as in vLLM
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
    policy: str = "fcfs"  # fcfs | priority | slo (core/policies)
    # slo policy: end a waiting request with 503 once its TTFT target can no longer be met (else it runs late)
    slo_shed: bool = False
    # Keep KV blocks that slid out of the attention window (vLLM's flag); by default a model whose layers all
    # share one sliding window releases them as requests advance.
    disable_hybrid_kv_cache_manager: bool = False
    # Most prompt tokens one request computes per step (vLLM's long_prefill_token_threshold); 0: no cap
    # beyond the budget. With a cap, a long prompt shares each step with other prompts instead of filling it,
    # and the step (so the running requests' inter-token latency) stays short.
    long_prefill_token_threshold: int = 0
    # Most prompts that stay in progress after a step (longer than their share of it) computed at once (vLLM's
    # flag); further long prompts wait for the budget the others leave, and shorter ones are admitted past them,
    # so a small request behind long prompts starts at once.
    max_long_partial_prefills: int = 1
    # KV slots reserved past each request's scheduled tokens for speculative drafts (set from the
    # speculative config: num_speculative_tokens).
    num_lookahead_tokens: int = 0
    # Distinct LoRA adapters the running requests may use at once (set from the LoRA config: max_loras).
    max_loras: int = 0


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # uni | mp | ray; None: uni for one worker, else mp
    enable_expert_parallel: bool = False  # MoE experts split whole across the tensor-parallel ranks
    # Every sequence's K/V split over this many ranks by block, partial attention merged by log-sum-exp
    # (layers/attention_backends/context_parallel.py); the weights replicated on each
    decode_context_parallel_size: int = 1
    # The step's tokens split over this many ranks for everything but attention (which stays split by K/V
    # block over the same ranks): a long prompt's matmuls shared out too. Implies the K/V split over them.
    prefill_context_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size

    @property
    def context_parallel_size(self) -> int:
        """Ranks each sequence's K/V is split over (innermost in the rank order); prefill context parallelism
        splits the tokens over the same ranks."""
        return max(self.decode_context_parallel_size, self.prefill_context_parallel_size)


def json_object(value: "str | dict", name: str) -> dict:
    """A JSON-object flag (vLLM's --speculative-config, --kv-transfer-config): text or a dict -> a new dict."""
    import json

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}.")
    return dict(value)


@dataclass
class LoRAConfig:
    """`--enable-lora` and vLLM's limits: adapters resident in one step, their largest rank, the host cache."""

    max_loras: int = 1  # distinct adapters in one step (device slots)
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None  # adapters kept loaded in host memory (LRU); None: max_loras

    def validate(self) -> None:
        _at_least(1, max_loras=self.max_loras, max_lora_rank=self.max_lora_rank, max_cpu_loras=self.max_cpu_loras)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras}).")


@dataclass
class SpeculativeConfig:
    """`--speculative-config` (vLLM's JSON shape). See docs/speculative.md."""

    method: str
    num_speculative_tokens: int = 3  # k: the most drafts verified per request and step
    model: str | None = None  # draft_model: the draft checkpoint; eagle/eagle3: the head's checkpoint
    prompt_lookup_min: int = 2  # ngram: shortest suffix matched
    prompt_lookup_max: int = 4  # ngram: longest suffix matched (tried first)
    draft_tensor_parallel_size: int | None = None  # only 1 (the draft runs beside each target rank's worker)
    quantization: str | None = None  # quantized_self: int4 (default) or int8; draft_model: as --quantization
    adaptive: bool = True  # choose k per step from acceptance and measured step costs (0: no drafts)
    disable_by_batch_size: int | None = None  # vLLM's name: no drafts while this many requests or more decode
    # medusa: the draft tree, each node as its path of top-k ranks (the Medusa repository's medusa_choices);
    # None: a default tree (spec_decode/medusa.py). num_speculative_tokens caps the nodes verified per step.
    medusa_choices: list[list[int]] | None = None
    # eagle/eagle3/mtp: EAGLE-2 dynamic draft trees (spec_decode/eagle_tree.py). tree_topk children per node and
    # nodes expanded per depth (1: a chain), tree_depth levels at most; num_speculative_tokens is the tree's
    # budget, the nodes verified per step (the best by cumulative draft probability).
    tree_topk: int = 1
    tree_depth: int = 4
    # dflash: send the longest prefix of the drafted block whose estimated acceptance stays at or above this
    # (spec_decode/dflash.py); 0: the whole block (up to the adaptive k).
    block_threshold: float = 0.3

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From JSON text, a dict or an instance; a clear ValueError for unknown keys or bad values."""
        from dataclasses import fields

        if value is None or isinstance(value, SpeculativeConfig):
            return value
        d = json_object(value, "speculative_config")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown speculative_config keys: {', '.join(unknown)}; known: {', '.join(sorted(names))}.")
        if d.get("method") == "deepseek_mtp":
            d["method"] = "mtp"
        if "method" not in d:
            if d.get("model") is None:
                raise ValueError("speculative_config needs a method (" + ", ".join(SPEC_METHODS) + ") or a model.")
            d["method"] = "draft_model"
        spec = cls(**d)
        spec.validate()
        return spec

    def validate(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; known: {', '.join(SPEC_METHODS)}.")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be an integer in 1..16, got {self.num_speculative_tokens!r}.")
        if self.method in ("draft_model", "eagle", "eagle3", "medusa", "dflash") and not self.model:
            raise ValueError(f"speculative method {self.method!r} needs a model (the draft's checkpoint).")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 64):
                raise ValueError(f"ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max <= 64, got {lo}, {hi}.")
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ValueError("draft_tensor_parallel_size: only 1 is supported (the draft runs in each target worker).")
        if self.quantization is not None and self.method not in ("quantized_self", "draft_model"):
            raise ValueError(f"speculative quantization applies to quantized_self and draft_model, not {self.method!r}.")
        if self.method == "quantized_self" and self.quantization not in (None, "int4", "int8"):
            raise ValueError(f"quantized_self drafts with int4 or int8 weights, not {self.quantization!r}.")
        if self.medusa_choices is not None:
            if self.method != "medusa":
                raise ValueError(f"medusa_choices applies to method medusa, not {self.method!r}.")
            from tokenmill.spec_decode.tree import choices_to_tree

            if not self.medusa_choices or not all(isinstance(c, list) and all(isinstance(x, int) and x >= 0 for x in c)
                                                  for c in self.medusa_choices):
                raise ValueError("medusa_choices must be a non-empty list of paths of top-k ranks, e.g. [[0], [1], [0, 0]].")
            choices_to_tree(self.medusa_choices)
        if (not isinstance(self.tree_topk, int) or not isinstance(self.tree_depth, int) or not 1 <= self.tree_topk <= 8
                or not 2 <= self.tree_depth <= 8):
            raise ValueError(f"tree_topk must be in 1..8 and tree_depth in 2..8, got {self.tree_topk!r}, {self.tree_depth!r}.")
        if self.tree_topk > 1 and self.method not in ("eagle", "eagle3", "mtp"):
            raise ValueError(f"tree_topk (EAGLE-2 draft trees) applies to eagle, eagle3 and mtp, not {self.method!r}.")
        if not isinstance(self.block_threshold, (int, float)) or not 0.0 <= self.block_threshold <= 1.0:
            raise ValueError(f"block_threshold must be a number in [0, 1], got {self.block_threshold!r}.")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be at least 1, got {self.disable_by_batch_size}.")


@dataclass
class KVTransferConfig:
    """`--kv-transfer-config` (vLLM's shape): disaggregated prefill/decode, see core/kv_connector.py."""

    kv_role: str  # kv_producer (prefill instance) | kv_consumer (decode instance) | kv_both
    kv_connector: str = "SharedStorageConnector"
    kv_connector_extra_config: dict = field(default_factory=dict)  # shared_storage_path: the hand-over folder

    @classmethod
    def parse(cls, value: "str | dict | KVTransferConfig | None") -> "KVTransferConfig | None":
        from dataclasses import fields

        from tokenmill.core.kv_connector import CONNECTORS, ROLES

        if value is None or isinstance(value, KVTransferConfig):
            return value
        value = json_object(value, "kv_transfer_config")
        known = {f.name for f in fields(cls)} | {"kv_rank", "kv_parallel_size", "kv_buffer_size", "kv_port", "kv_ip"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown kv_transfer_config keys: {', '.join(unknown)}.")
        d = {k: v for k, v in value.items() if k in {f.name for f in fields(cls)}}
        if d.get("kv_role") not in ROLES:
            raise ValueError(f"kv_transfer_config kv_role must be one of {', '.join(ROLES)}, got {d.get('kv_role')!r}.")
        if d.get("kv_connector", CONNECTORS[0]) not in CONNECTORS:
            raise ValueError(f"kv_connector {d['kv_connector']!r} is not available; known: {', '.join(CONNECTORS)}.")
        return cls(**d)


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = "cpu"
    attention_backend: str | None = None  # None: the device's default backend
    enforce_eager: bool = False  # never capture CUDA graphs (executor/cuda_graphs.py)
    speculative: SpeculativeConfig | None = None
    kv_transfer: KVTransferConfig | None = None
    lora: LoRAConfig | None = None  # None: adapters off

    def __post_init__(self) -> None:
        if self.speculative is not None:  # KV slots for the drafts past each request's scheduled tokens
            self.scheduler.num_lookahead_tokens = self.speculative.num_speculative_tokens
        if self.lora is not None:
            self.scheduler.max_loras = self.lora.max_loras

    def _check_context_parallel(self) -> None:
        """The combinations context parallelism does not run with yet, each refused with its reason."""
        p, c = self.parallel, self.cache
        dcp, pcp = p.decode_context_parallel_size, p.prefill_context_parallel_size
        flag = (f"--prefill-context-parallel-size {pcp}" if pcp > 1 else f"--decode-context-parallel-size {dcp}")
        refused = [
            (dcp > 1 and pcp > 1 and dcp != pcp,
             f"with --decode-context-parallel-size {dcp} (the tokens split over the ranks the K/V is split over: "
             "give one size, or equal sizes)"),
            (p.pipeline_parallel_size > 1, "with pipeline parallelism (stages of context-parallel ranks)"),
            (pcp > 1 and self.lora is not None, "with LoRA adapters (the adapters' rows are not split)"),
            (self.speculative is not None, "with speculative decoding (a drafter's K/V is not split)"),
            (bool(c.kv_offload_bytes or c.kv_offload_dir), "with KV offloading (a block lives on one rank only)"),
            (self.kv_transfer is not None, "with a KV connector (a block lives on one rank only)"),
            (c.kv_cache_dtype in ("int8", "fp8", "fp8_e4m3"), "with a quantized KV cache"),
            (self.attention_backend not in (None, "torch_sdpa"),
             f"with attention backend {self.attention_backend!r} (it runs its own masked torch attention)"),
        ]
        for bad, why in refused:
            if bad:
                raise ValueError(f"{flag} does not run {why} yet.")

    def validate(self) -> None:
        m, c, s, p = self.model, self.cache, self.scheduler, self.parallel
        _at_least(1, max_model_len=m.max_model_len, block_size=c.block_size,
                  kv_cache_memory_bytes=c.kv_cache_memory_bytes, num_gpu_blocks_override=c.num_gpu_blocks_override,
                  max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                  max_long_partial_prefills=s.max_long_partial_prefills,
                  kv_offload_group_blocks=c.kv_offload_group_blocks, tensor_parallel_size=p.tensor_parallel_size,
                  pipeline_parallel_size=p.pipeline_parallel_size,
                  decode_context_parallel_size=p.decode_context_parallel_size,
                  prefill_context_parallel_size=p.prefill_context_parallel_size)
        if p.context_parallel_size > 1:
            self._check_context_parallel()
        _at_least(0, kv_offload_bytes=c.kv_offload_bytes, kv_offload_disk_bytes=c.kv_offload_disk_bytes,
                  kv_offload_min_blocks=c.kv_offload_min_blocks,
                  long_prefill_token_threshold=s.long_prefill_token_threshold)
        if m.weights_resident_gb is not None and not m.weights_resident_gb > 0:
            raise ValueError(f"weights_resident_gb must be positive, got {m.weights_resident_gb}.")
        if m.weights_resident_gb is not None and self.device != "cpu":
            raise ValueError("--weights-resident-gb streams weights from disk into CPU memory; on a GPU, keep some "
                             "of the weights in host memory with --cpu-offload-gb.")
        if m.cpu_offload_gb < 0:
            raise ValueError(f"cpu_offload_gb must be at least 0, got {m.cpu_offload_gb}.")
        if m.cpu_offload_gb and self.device == "cpu":
            raise ValueError("--cpu-offload-gb keeps weights in host memory for a GPU; on the CPU they are there "
                             "already (--weights-resident-gb N streams the ones beyond N GiB from disk).")
        for name, value in (("kv_cache_memory_fraction", c.kv_cache_memory_fraction),
                            ("gpu_memory_utilization", c.gpu_memory_utilization)):
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value}.")
        if c.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {c.kv_cache_dtype!r}.")
        if (c.kv_offload_bytes or c.kv_offload_dir) and not c.enable_prefix_caching:
            raise ValueError("kv_offload_bytes / kv_offload_dir need prefix caching (enable_prefix_caching=True).")
        if m.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}, got {m.pooling!r}.")
        if s.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {s.policy!r}.")
        if s.slo_shed and s.policy != "slo":
            raise ValueError("slo_shed needs the slo scheduling policy (--scheduling-policy slo).")
        if p.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                             f"got {p.distributed_executor_backend!r}.")
        if p.distributed_executor_backend == "uni" and p.world_size > 1:
            raise ValueError(
                f"distributed_executor_backend 'uni' runs one worker; world size {p.world_size} needs 'mp'."
            )
        if self.speculative is not None:
            self.speculative.validate()
        if self.kv_transfer is not None and p.world_size > 1:
            raise ValueError("kv_transfer_config with tensor or pipeline parallelism is not supported yet.")
        if self.kv_transfer is not None and not c.enable_prefix_caching:
            raise ValueError("kv_transfer_config needs prefix caching: blocks are handed over by their prefix hash.")
        if self.lora is not None:
            self.lora.validate()
            if self.speculative is not None and self.speculative.method != "ngram":
                raise ValueError(f"LoRA adapters with speculative method {self.speculative.method!r}: its drafter "
                                 "knows only the base model, so adapter requests would accept few drafts; use "
                                 "ngram (model-free) or no speculation.")
        if p.pipeline_parallel_size > 1 and self.speculative is not None:
            raise ValueError("speculative decoding with pipeline parallelism is not supported yet.")


def _at_least(low: int, **values: int | None) -> None:
    """Raise for the first value below `low`; None means "not set" and passes."""
    for name, value in values.items():
        if value is not None and value < low:
            rule = f"be at least {low}" if low else "not be negative"
            raise ValueError(f"{name} must {rule}, got {value}.")
