"""EngineArgs: every engine setting once, with vLLM's name and its help text.

The argparse flags (`add_cli_args`) and the `LLM(**kwargs)` keywords are generated from these fields, and
`create_engine_config` maps them onto the per-area dataclasses of config.py, in one place. A new setting
is a field here (its CLI flag and LLM keyword follow), a field in config.py and a line in
`create_engine_config`; tests/cli/test_engine_args.py fails until all three exist.
"""
from __future__ import annotations

import argparse
import difflib
import re
import types
from dataclasses import Field, dataclass, field, fields
from typing import Any, Callable, Sequence, get_type_hints

from tokenmill.config import (
    ACTIVATION_QUANTIZATIONS,
    DTYPES,
    EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    QUANTIZED_BATCH_DTYPES,
    POOLING_TYPES,
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    KVTransferConfig,
    LoRAConfig,
    SpeculativeConfig,
)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'1073741824', '512M', '2G', '1.5GiB' -> bytes (K/M/G/T are powers of 1024)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use a byte count or a number with K, M, G or T")
    power = "kmgt".find(m.group(2).lower()) + 1 if m.group(2) else 0
    return int(float(m.group(1)) * 1024**power)


def _arg(default: Any, help: str, *, parse: Callable[[str], Any] | None = None, choices: Sequence[str] | None = None,
         metavar: str | None = None, short: str | None = None, positional: bool = False) -> Any:
    """A field whose metadata says how it appears on the command line; `parse` defaults to the field's type."""
    meta = dict(help=help, parse=parse, choices=choices, metavar=metavar, short=short, positional=positional)
    return field(default=default, metadata=meta)


@dataclass
class EngineArgs:
    # model
    model: str | None = _arg(
        ModelConfig.model, "Hugging Face model folder or .gguf file, or a Hugging Face Hub id fetched into its cache: "
        "ORG/NAME (safetensors), ORG/NAME:QUANT or ORG/NAME/FILE.gguf (a GGUF repository's file); a local path "
        "that exists wins over an id; HF_TOKEN for private and gated repositories, HF_HUB_OFFLINE=1 reads the "
        "cache only (default: the embedded SmolLM2-135M-Instruct).", positional=True)
    tokenizer: str | None = _arg(ModelConfig.tokenizer, "Tokenizer folder or Hub id (default: the model's).")
    revision: str | None = _arg(ModelConfig.revision, "The branch, tag or commit of a Hub id's repository "
                                "(default: main).")
    download_dir: str | None = _arg(ModelConfig.download_dir, "The Hugging Face cache folder Hub ids are fetched "
                                    "into and read from (default: $HF_HUB_CACHE, else $HF_HOME/hub, else "
                                    "~/.cache/huggingface/hub).", metavar="DIR")
    dtype: str = _arg(ModelConfig.dtype, "Weight dtype; auto keeps the model's dtype where this device computes in it, "
                      "else float32 (default: %(default)s).", choices=DTYPES)
    max_model_len: int | None = _arg(
        ModelConfig.max_model_len,
        "Context length: prompt plus output tokens (default: the model's max_position_embeddings).")
    seed: int = _arg(ModelConfig.seed, "Seed of the engine's global random generator; with it a run is reproducible "
                     "(default: %(default)s). A request with a seed of its own (the API's `seed` field, "
                     "`generate --sampling-seed`) samples independently of it.")
    quantization: str | None = _arg(
        ModelConfig.quantization, "Quantize the linear layers' weights at load: int8 (per output channel) or int4 "
        "(groups of --quantization-group-size columns); gguf keeps a .gguf file's Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K "
        "blocks as they are (the default for .gguf files); none dequantizes them at load. gptq, awq, fp8, mxfp4 "
        "(gpt-oss's experts): the checkpoint is pre-quantized (found from its config.json without the flag; with it, they must agree). "
        "Activations stay float (default: gguf for .gguf files, the checkpoint's method, else none).",
        choices=("int8", "int4", "gguf", "gptq", "awq", "fp8", "mxfp4", "none"))
    quantization_group_size: int = _arg(ModelConfig.quantization_group_size,
                                        "int4: input columns per scale and zero point: 32, 64 or 128 "
                                        "(default: %(default)s).")
    activation_quantization: str = _arg(
        ModelConfig.activation_quantization, "int8: the kernels of packed weights (GGUF Q4_0/Q4_1/Q8_0, "
        "int4, int8) quantize each row of activations to int8 per 32 columns and take integer dot products, as "
        "llama.cpp does: faster where the kernels are compute-bound, results differ from float activations by "
        "that rounding (~0.5 %% of each block's largest value; a row's result never depends on the rest of the "
        "batch). int8_per_token: the same, except that int8 weights take one scale per row of activations and an "
        "exact int32 product (torch._int_mm: oneDNN's VNNI/AMX kernels; W8A8 as vLLM's dynamic per-token), "
        "4-5x float32 from 16 rows where the CPU has VNNI. none keeps float32 activations, exact against "
        "transformers (default: %(default)s).", choices=ACTIVATION_QUANTIZATIONS)
    quantized_batch_dtype: str = _arg(
        ModelConfig.quantized_batch_dtype, "bfloat16: batches of 32 or more rows through GGUF block weights (prompt "
        "processing, many sequences decoding) dequantize panels of weight rows into bf16 and run bf16 GEMMs "
        "(oneDNN: AMX or AVX-512 BF16 where the CPU has them; 4-5x float32 for a 512-token prompt on a Xeon with "
        "AMX). Activations, weights and results are rounded to bf16, so outputs differ slightly from float32; "
        "decode of fewer rows is unchanged. Slower than float32 on CPUs without native bf16 (AVX2 only). "
        "float32 keeps float panels and SGEMM, exact against transformers (default: %(default)s).",
        choices=QUANTIZED_BATCH_DTYPES)
    weights_resident_gb: float | None = _arg(
        ModelConfig.weights_resident_gb, "CPU: keep at most N GiB of weights in memory and stream the other decoder "
        "layers from a file on disk every step, read ahead on a background thread (output unchanged; the speed is "
        "then the disk's: the start-up log and /v1/diagnostics say how many bytes each step streams and which bound "
        "sets the speed). Default: every weight resident.", parse=float, metavar="N")
    weights_stream_dir: str | None = _arg(ModelConfig.weights_stream_dir, "Folder for the stream file of "
                                          "--weights-resident-gb (default: the system's temporary folder).")
    cpu_offload_gb: float = _arg(
        ModelConfig.cpu_offload_gb, "GPU: keep N GiB of the weights (whole decoder layers, spread over the stack) in "
        "pinned host memory, copied to the device layer by layer each step on a side stream, ahead of use; the "
        "speed is then the host link's for those bytes (default: %(default)s).", parse=float, metavar="N")
    pooling: str = _arg(ModelConfig.pooling, "Embedding requests (POST /v1/embeddings, LLM.embed): last pools the "
                        "final hidden state (after the final norm) of the prompt's last token, mean averages it over "
                        "every prompt token (default: %(default)s).", choices=POOLING_TYPES)
    device: str = _arg(EngineConfig.device, "Torch device, e.g. cpu or cuda (default: %(default)s).")
    attention_backend: str | None = _arg(
        EngineConfig.attention_backend, "Attention backend by registry name, e.g. torch_sdpa (default: the "
        "device's default).", metavar="NAME")
    enforce_eager: bool = _arg(
        EngineConfig.enforce_eager, "Never capture CUDA graphs: every decode step runs eagerly (on CUDA, decode "
        "batches of up to --max-num-seqs otherwise replay graphs captured per padded batch size; default: off).")
    # KV cache
    block_size: int = _arg(CacheConfig.block_size, "Tokens per KV cache block (default: %(default)s).")
    kv_cache_dtype: str = _arg(CacheConfig.kv_cache_dtype, "KV cache dtype; auto: the weights' storage dtype; "
                               "int8: per-token-per-head scales; fp8 (= fp8_e4m3): per-layer scales "
                               "(default: %(default)s).", choices=KV_CACHE_DTYPES)
    enable_prefix_caching: bool = _arg(CacheConfig.enable_prefix_caching,
                                       "Reuse KV cache blocks of shared prompt prefixes (default: on).")
    kv_cache_memory_bytes: int | None = _arg(
        CacheConfig.kv_cache_memory_bytes, "KV cache size, e.g. 512M or 2G (default: sized from free memory, see "
        "--kv-cache-memory-fraction and --gpu-memory-utilization).", parse=parse_bytes, metavar="SIZE")
    kv_cache_memory_fraction: float = _arg(
        CacheConfig.kv_cache_memory_fraction, "On CPU, the fraction of available RAM the KV cache takes when no "
        "--kv-cache-memory-bytes is given, at most 4 GiB (default: %(default)s).", metavar="FRACTION")
    gpu_memory_utilization: float = _arg(
        CacheConfig.gpu_memory_utilization, "On CUDA, the fraction of GPU memory for weights, activations and the "
        "KV cache, as in vLLM (default: %(default)s).", metavar="FRACTION")
    num_gpu_blocks_override: int | None = _arg(
        CacheConfig.num_gpu_blocks_override, "Exact number of KV cache blocks; overrides --kv-cache-memory-bytes.",
        metavar="N")
    kv_offload_bytes: int = _arg(
        CacheConfig.kv_offload_bytes, "Host-memory tier for KV blocks evicted from the pool, e.g. 2G; a later "
        "request with the same prefix loads them back instead of recomputing (default: 0, off).",
        parse=parse_bytes, metavar="SIZE")
    kv_offload_dir: str | None = _arg(
        CacheConfig.kv_offload_dir, "Disk tier below the host tier: evicted host blocks are written here, "
        "checksummed (default: none).", metavar="DIR")
    kv_offload_disk_bytes: int | None = _arg(
        CacheConfig.kv_offload_disk_bytes, "Budget of the disk tier (default: unbounded).", parse=parse_bytes,
        metavar="SIZE")
    kv_offload_group_blocks: int = _arg(CacheConfig.kv_offload_group_blocks,
                                        "KV blocks per disk-tier file (default: %(default)s).", metavar="N")
    kv_offload_min_blocks: int | None = _arg(
        CacheConfig.kv_offload_min_blocks, "Load offloaded prefixes back only for chains of at least N blocks "
        "(default: the break-even length measured at start-up).", metavar="N")
    # scheduler
    max_num_seqs: int = _arg(SchedulerConfig.max_num_seqs, "Most sequences running in one step (default: %(default)s).")
    max_num_batched_tokens: int = _arg(SchedulerConfig.max_num_batched_tokens,
                                       "Most tokens processed in one step (default: %(default)s).")
    long_prefill_token_threshold: int = _arg(
        SchedulerConfig.long_prefill_token_threshold,
        "Most prompt tokens one request computes per step, so a long prompt shares steps with other prompts "
        "and running decodes keep short steps; 0: only the step budget chunks (default: %(default)s).")
    max_long_partial_prefills: int = _arg(
        SchedulerConfig.max_long_partial_prefills,
        "Most long prompts (that do not finish within their share of a step) computed at once; shorter prompts "
        "are admitted past the others, which get the budget left over (default: %(default)s).")
    scheduling_policy: str = _arg(SchedulerConfig.policy, "Who is admitted and preempted first: fcfs by arrival; "
                                  "priority by each request's priority, lower first; slo by each request's TTFT "
                                  "and TPOT targets, batch work (no SLO) in the time left (default: %(default)s).",
                                  choices=SCHEDULING_POLICIES)
    disable_hybrid_kv_cache_manager: bool = _arg(
        SchedulerConfig.disable_hybrid_kv_cache_manager, "Keep every KV block of a request to its end; by default "
        "a model whose attention layers all share one sliding window (Mistral) releases blocks that slid out of it.")
    slo_shed: bool = _arg(SchedulerConfig.slo_shed, "With --scheduling-policy slo: end a waiting request with 503 + "
                          "Retry-After once its TTFT target can no longer be met (default: it runs late).")
    # parallelism
    tensor_parallel_size: int = _arg(ParallelConfig.tensor_parallel_size,
                                     "Tensor-parallel workers: one process per rank over torch.distributed "
                                     "(gloo on CPU, NCCL on CUDA) (default: %(default)s).",
                                     metavar="N", short="-tp")
    pipeline_parallel_size: int = _arg(ParallelConfig.pipeline_parallel_size,
                                       "Pipeline-parallel stages: the layers split over N ranks, each step in "
                                       "two micro-batches so the stages overlap (default: %(default)s).",
                                       metavar="N", short="-pp")
    decode_context_parallel_size: int = _arg(
        ParallelConfig.decode_context_parallel_size, "Context-parallel ranks: every sequence's K/V split over N "
        "processes by block (N times the context in the same memory per rank), each rank attending to its share "
        "and the partial results merged by log-sum-exp; the weights are replicated (default: %(default)s).",
        metavar="N", short="-dcp")
    prefill_context_parallel_size: int = _arg(
        ParallelConfig.prefill_context_parallel_size, "Prefill context parallelism: the step's tokens split over N "
        "processes for the matmuls (a long prompt computed by all of them), the K/V split over the same N by block "
        "as -dcp, each rank attending every query to its share of the keys (default: %(default)s).",
        metavar="N", short="-pcp")
    distributed_executor_backend: str | None = _arg(
        ParallelConfig.distributed_executor_backend, "How workers run: uni in this process, mp one process each, "
        "ray one Ray actor each, on this node or a cluster (RAY_ADDRESS) (default: uni for one worker, else mp).",
        choices=EXECUTOR_BACKENDS)

    enable_expert_parallel: bool = _arg(
        ParallelConfig.enable_expert_parallel, "MoE models: split the experts whole over the tensor-parallel ranks "
        "(each rank runs its own experts for every token routed to them) instead of slicing every expert; "
        "attention stays tensor-parallel (default: off).")
    kv_transfer_config: str | None = _arg(  # LLM(kv_transfer_config=...) also takes a dict
        None, "Disaggregated prefill/decode as JSON, vLLM's shape: {\"kv_role\": \"kv_producer\"|\"kv_consumer\"|"
        "\"kv_both\", \"kv_connector\": \"SharedStorageConnector\", \"kv_connector_extra_config\": "
        "{\"shared_storage_path\": DIR}}; see docs/scaling.md (default: off).", parse=str, metavar="JSON")
    # LoRA adapters
    enable_lora: bool = _arg(False, "Serve LoRA adapters on top of the base model (PEFT folders or GGUF LoRA "
                             "files), mixed in one batch; see docs/lora.md (default: off).")
    max_loras: int = _arg(LoRAConfig.max_loras, "With --enable-lora: the most distinct adapters in one step (device "
                          "slots; requests for another adapter wait for a slot) (default: %(default)s).")
    max_lora_rank: int = _arg(LoRAConfig.max_lora_rank, "With --enable-lora: the largest adapter rank accepted "
                              "(default: %(default)s).")
    max_cpu_loras: int | None = _arg(LoRAConfig.max_cpu_loras, "With --enable-lora: adapters kept loaded in host "
                                     "memory, least recently used dropped first (default: --max-loras).")
    # speculative decoding
    speculative_config: str | None = _arg(  # LLM(speculative_config=...) also takes a dict
        None, "Speculative decoding as JSON, vLLM's shape: {\"method\": \"ngram\"|\"draft_model\"|\"quantized_self\"|"
        "\"eagle\"|\"eagle3\"|\"mtp\", \"num_speculative_tokens\": k, \"model\": PATH, \"prompt_lookup_min\"/"
        "\"prompt_lookup_max\": n, ...}; see docs/speculative.md (default: off).", parse=str, metavar="JSON")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """EngineArgs(**kwargs), with an unknown keyword named and the closest field suggested."""
        names = [f.name for f in fields(cls)]
        for key in kwargs:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else "; see tokenmill.engine_args.EngineArgs."
                raise TypeError(f"unexpected engine keyword argument {key!r}{hint}")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        g = parser.add_argument_group("engine")
        hints = get_type_hints(cls)
        for f in fields(cls):
            meta = f.metadata
            if meta["positional"]:
                g.add_argument(f"{f.name}_pos", nargs="?", metavar=f.name.upper(), help=meta["help"])
                g.add_argument(f"--{_flag(f)}", help=f"Same as the positional {f.name.upper()}.")
                continue
            names = [meta["short"]] if meta["short"] else []
            names.append(f"--{_flag(f)}")
            kind = _base_type(hints[f.name])
            if kind is bool:
                g.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                               help=meta["help"])
            else:
                g.add_argument(*names, dest=f.name, type=meta["parse"] or kind, default=f.default,
                               choices=meta["choices"], metavar=meta["metavar"], help=meta["help"])
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        values, flags = {}, vars(args)  # the flags by field name
        for f in fields(cls):
            value = flags[f.name]
            if f.metadata["positional"]:
                given = flags[f"{f.name}_pos"]
                if value and given and value != given:
                    raise ValueError(f"two different {f.name}s given: {given!r} and --{_flag(f)} {value!r}.")
                value = value or given
            values[f.name] = value
        return cls(**values)

    def create_engine_config(self) -> EngineConfig:
        config = EngineConfig(
            model=ModelConfig(model=self.model, tokenizer=self.tokenizer, revision=self.revision,
                              download_dir=self.download_dir, dtype=self.dtype,
                              max_model_len=self.max_model_len, seed=self.seed, quantization=self.quantization,
                              quantization_group_size=self.quantization_group_size,
                              activation_quantization=self.activation_quantization,
                              quantized_batch_dtype=self.quantized_batch_dtype,
                              weights_resident_gb=self.weights_resident_gb,
                              weights_stream_dir=self.weights_stream_dir,
                              cpu_offload_gb=self.cpu_offload_gb, pooling=self.pooling),
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_dtype=self.kv_cache_dtype,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_memory_fraction=self.kv_cache_memory_fraction,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_offload_bytes=self.kv_offload_bytes,
                kv_offload_dir=self.kv_offload_dir,
                kv_offload_disk_bytes=self.kv_offload_disk_bytes,
                kv_offload_group_blocks=self.kv_offload_group_blocks,
                kv_offload_min_blocks=self.kv_offload_min_blocks,
            ),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=self.max_num_batched_tokens,
                                      long_prefill_token_threshold=self.long_prefill_token_threshold,
                                      max_long_partial_prefills=self.max_long_partial_prefills,
                                      policy=self.scheduling_policy, slo_shed=self.slo_shed,
                                      disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                    pipeline_parallel_size=self.pipeline_parallel_size,
                                    decode_context_parallel_size=self.decode_context_parallel_size,
                                    prefill_context_parallel_size=self.prefill_context_parallel_size,
                                    distributed_executor_backend=self.distributed_executor_backend,
                                    enable_expert_parallel=self.enable_expert_parallel),
            device=self.device,
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            speculative=SpeculativeConfig.parse(self.speculative_config),
            kv_transfer=KVTransferConfig.parse(self.kv_transfer_config),
            lora=LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                            max_cpu_loras=self.max_cpu_loras) if self.enable_lora else None,
        )
        config.validate()
        return config


def _flag(f: Field) -> str:
    return f.name.replace("_", "-")


def _base_type(hint: Any) -> type:
    """int | None -> int."""
    if isinstance(hint, types.UnionType):
        (hint,) = [t for t in hint.__args__ if t is not type(None)]
    return hint
