"""A worker owns one device: it joins torch.distributed, loads its model shard, sizes and allocates its KV
pool, and runs the batches the executor hands it."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.config import EngineConfig
from tokenmill.core.batch import ModelRunnerOutput, ScheduledBatch
from tokenmill.core.kv_cache import blocks_for_tokens
from tokenmill.executor.kv_groups import off_reasons
from tokenmill.executor.model_runner import ModelRunner

log = logging.getLogger(__name__)

GiB = 1 << 30
# On CPU with no explicit budget, the KV pool takes this share of available memory, at most
# DEFAULT_CPU_KV_BYTES (vLLM's CPU default, VLLM_CPU_KVCACHE_SPACE=4 GiB). Pages are touched only when a
# block is first used, so a large pool costs nothing until requests fill it.
DEFAULT_CPU_KV_BYTES = 4 * GiB


class _ResidentParameters:
    """A model as seen through its resident parameters only (those not in `skip`, by id), for the start-up log's
    GGUF breakdown: the streamed ones are counted on their own."""

    def __init__(self, model: torch.nn.Module, skip: dict[int, int]) -> None:
        self.model, self.skip = model, skip

    def named_parameters(self):
        return ((n, p) for n, p in self.model.named_parameters() if id(p) not in self.skip)

    def __getattr__(self, name: str):
        return getattr(self.model, name)  # delegation: any attribute of the wrapped model


@dataclass
class WorkerInfo:
    """What the core needs to know about the workers (picklable)."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    vocab_size: int
    device: str
    kv_dtype: str
    compute_dtype: str
    model_cost: Any  # diagnostics.ModelCost
    offload: Any = None  # kv_transfer.OffloadSpec when lower KV tiers are on
    attention_backend: str = ""
    lora_shapes: dict | None = None  # --enable-lora: checkpoint module (q_proj, ...) -> (in, out), to check adapters
    num_layers: int = 0
    # The KV cache groups' attention windows (executor/kv_groups.py; None: full attention), in group order.
    kv_group_windows: tuple[int | None, ...] = (None,)
    weights: dict | None = None  # --weights-resident-gb: model/weight_store.WeightStore.describe()


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


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1,
                 distributed_init_method: str | None = None) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.distributed_init_method = distributed_init_method
        self.cpu_group = None  # torch.distributed group for control messages (None: the default group, gloo)
        self.device = torch.device(config.device)
        self.runner: ModelRunner | None = None
        self._cuda_used_by_others = 0  # bytes of the device held outside this engine, as the KV sizing saw them
        self.kv_group_windows: tuple[int | None, ...] = (None,)  # executor/kv_groups.py, set by init()
        self.cp_size = 1  # decode context parallelism's ranks, set by init()
        self.transfer = None
        self.connector = None  # executor/kv_connector.ConnectorWorker with --kv-transfer-config

    # ---- start-up ------------------------------------------------------------------------
    def init_device(self) -> None:
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else self.rank
            self.device = torch.device("cuda", index)
            torch.cuda.set_device(self.device)
        if self.distributed_init_method is not None:
            import torch.distributed as dist

            if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
                # Ranks share the machine's cores: two ranks of two threads each on two cores would make
                # every GEMM wait for a preempted thread.
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.world_size))
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=self.distributed_init_method, rank=self.rank,
                                    world_size=self.world_size)
            # Control messages (the step each rank runs, the KV pool size) travel over gloo on the CPU, as
            # vLLM's CPU group: on NCCL they would need device tensors and a device sync per step.
            self.cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else None
            par = self.config.parallel
            tp, pp, cp = par.tensor_parallel_size, par.pipeline_parallel_size, par.context_parallel_size
            from tokenmill.layers import collectives

            if tp > 1 and pp > 1:  # each stage's tensor-parallel collectives stay within the stage
                for stage in range(pp):
                    group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)))
                    if stage == self.rank // tp:
                        collectives.set_group(group)
            if tp > 1 and cp > 1:  # rank = tp_rank * cp + cp_rank: TP over equal cp_rank, CP over equal tp_rank
                for c in range(cp):  # every rank creates every group, in the same order
                    group = dist.new_group([t * cp + c for t in range(tp)])
                    if c == self.rank % cp:
                        collectives.set_group(group)
                for t in range(tp):
                    group = dist.new_group([t * cp + c for c in range(cp)])
                    if t == self.rank // cp:
                        collectives.set_cp_group(group)

    def init(self) -> WorkerInfo:
        """Device, model, KV pool and lower KV tiers; returns what the core needs to know."""
        from tokenmill.layers.attention_backends.registry import get_attention_backend
        from tokenmill.layers.quantization import get_quantization_config
        from tokenmill.model.loader import load_model

        self.init_device()
        mc, cache = self.config.model, self.config.cache
        quant = get_quantization_config(mc.quantization, mc.quantization_group_size,
                                        model=mc.model, device=str(self.device),
                                        activations=mc.activation_quantization)
        tp = self.config.parallel.tensor_parallel_size
        cp = self.cp_size = self.config.parallel.context_parallel_size
        model_rank = self.rank // cp  # context-parallel ranks hold the same weights (innermost in the rank order)
        model, self.hf_config, self.max_model_len = load_model(mc.model, mc.dtype, mc.max_model_len, str(self.device),
                                                               quant_config=quant, tp_rank=model_rank % tp, tp_size=tp,
                                                               expert_parallel=self.config.parallel.enable_expert_parallel,
                                                               pp_rank=model_rank // tp,
                                                               pp_size=self.config.parallel.pipeline_parallel_size)
        quant = getattr(model, "quant_config", quant)  # a pre-quantized checkpoint's, found in its config.json
        if mc.weights_resident_gb is not None:  # the layers beyond the budget stream from disk (model/weight_store.py)
            from tokenmill.model.weight_store import WeightStore

            WeightStore.attach(model, int(mc.weights_resident_gb * 2**30), mc.weights_stream_dir)
        if mc.cpu_offload_gb:  # layers holding that many bytes live in host memory (model/host_offload.py)
            from tokenmill.model.host_offload import HostOffload

            HostOffload.attach(model, int(mc.cpu_offload_gb * 2**30), self.device)
        from tokenmill import native
        from tokenmill.diagnostics import resident_weight_bytes, streamed_parameters, streamed_where

        # getattr: quant is None or any QuantizationConfig; only some formats have int8 activations
        x8 = bool(getattr(quant, "int8_activations", False))
        how = ""
        if x8:
            per_token = getattr(quant, "per_token_activations", False)
            how = f", int8 activations: {'per token, torch._int_mm' if per_token else native.int8_dot_path()}"
        # Streamed weights are not resident: counting them here contradicted the store's own line above.
        streamed = sum(p.numel() * p.element_size() for p in streamed_parameters(model))
        log.info("weights: %.1f MiB resident%s%s", (resident_weight_bytes(model) - streamed) / 2**20,
                 f", {streamed / 2**20:.1f} MiB {streamed_where(model.weight_store.describe())}" if streamed else "",
                 f" ({quant.name}{how})" if quant else "")
        if mc.activation_quantization != "none" and not x8:
            log.warning("--activation-quantization %s acts on gguf, int8 and int4 weights; with %s weights "
                        "activations stay float32", mc.activation_quantization, quant.name if quant else "float")
        backend_cls = get_attention_backend(self.config.attention_backend, self.device)
        vocab = int(self.hf_config.vocab_size)
        from tokenmill.spec_decode.decoder import build_spec_decoder

        spec = build_spec_decoder(self.config, model, backend_cls, cache.block_size, self.device, vocab,
                                  self.max_model_len)
        if cp > 1:  # this rank's share of every sequence's K/V (layers/attention_backends/context_parallel.py)
            from tokenmill.layers.attention_backends.context_parallel import ContextParallelBackend

            backend = ContextParallelBackend(cache.block_size, self.device, self.rank % cp, cp,
                                             split_tokens=self.config.parallel.prefill_context_parallel_size > 1)
        else:
            backend = backend_cls(cache.block_size, self.device)
        self.runner = ModelRunner(model, vocab, cache.block_size, self.device, backend, spec)
        if cp > 1:
            self.runner.token_split = backend.token_split
        lora = self.config.lora
        if lora is not None:  # before the KV pool is sized: the slots take memory
            from tokenmill.lora.manager import LoRAManager

            self.runner.lora = LoRAManager(model, lora.max_loras, lora.max_lora_rank,
                                           lora.max_cpu_loras or lora.max_loras, self.device)
            log.info("LoRA: %d slot(s) of rank up to %d in %d layers, %.1f MiB", lora.max_loras, lora.max_lora_rank,
                     len(self.runner.lora.targets.layers), self.runner.lora.nbytes / 2**20)
        kv_dtype = kv_dtype_for(cache.kv_cache_dtype, model)
        self.kv_group_windows = self.runner.configure_kv_groups(off_reasons(self.config, spec))
        self.plan_graphs()
        num_blocks = self.determine_num_blocks(kv_dtype)
        self.runner.allocate_kv_cache(num_blocks, kv_dtype)
        if self.runner.graph_mode is not None:
            self.runner.capture_graphs(*self._graph_shapes())
        log.info("KV cache: %d blocks x %d tokens, %.1f MiB (kv_cache_dtype %s: %s); attention backend %s", num_blocks,
                 cache.block_size, num_blocks * self.runner.bytes_per_block / 2**20,
                 cache.kv_cache_dtype, str(kv_dtype).removeprefix("torch."), type(self.runner.backend).describe())
        self.log_resident_memory(model, quant)
        offload = None
        from tokenmill.executor.kv_transfer import build_transfer

        built = build_transfer(cache, self.runner)
        if built is not None:
            self.transfer, offload = built
        kv_transfer = self.config.kv_transfer
        if kv_transfer is not None:
            from tokenmill.core.kv_connector import store_path
            from tokenmill.executor.kv_connector import ConnectorWorker

            self.connector = ConnectorWorker(self.runner.kv_caches(), store_path(kv_transfer))
        torch.manual_seed(mc.seed)  # after loading, so sampling draws the same in any process
        targets = self.runner.lora.targets if self.runner.lora is not None else None
        store = getattr(model, "weight_store", None)  # set by WeightStore / HostOffload.attach only
        # The core's pool: every rank's local blocks (context parallelism: global block b is rank b % cp's b // cp).
        return WorkerInfo(num_blocks * cp, cache.block_size, self.runner.bytes_per_block, self.max_model_len, vocab,
                          str(self.device), str(kv_dtype).removeprefix("torch."),
                          str(model.compute_dtype).removeprefix("torch."), self.model_cost(), offload,
                          self.runner.backend.name, targets.shapes if targets else None, targets.num_layers if targets else 0,
                          self.kv_group_windows, store.describe() if store is not None else None)

    def plan_graphs(self) -> None:
        """Whether decode steps will replay CUDA graphs (executor/cuda_graphs.py), decided before the pool is
        sized (the graphs' pad block is one past it); the reason is logged when the device has graphs but this
        configuration cannot use them."""
        from tokenmill.executor.cuda_graphs import graph_mode

        mode = graph_mode(self.device, self.config.enforce_eager)
        why = self.runner.graph_blockers() if mode is not None else None
        if why is None and mode is not None and self.config.parallel.world_size > 1:
            why = "more than one rank (capturing collectives is not yet proven on a GPU)"
        if why is not None:
            log.info("CUDA graphs off: %s; decode steps run eagerly", why)
            mode = None
        self.runner.graph_mode = mode

    def log_resident_memory(self, model: torch.nn.Module, quant) -> None:
        """One INFO line on what this process holds after loading: weight bytes by kind (GGUF blocks, packed,
        float; the float ones dequantized from a quantized GGUF tensor with the reason), model buffers, the KV
        pool reserved vs touched (a CPU pool is never pre-zeroed, so its pages cost RSS only once a block is
        written) and the process RSS."""
        from tokenmill.model.loader import is_gguf
        from tokenmill.model.mapped_pages import process_memory, resident_bytes

        from tokenmill.diagnostics import streamed_parameters, streamed_where

        MiB = 2**20
        streamed = {id(p): p.numel() * p.element_size() for p in streamed_parameters(model)}
        blocks = packed = floats = onednn = 0
        for p in model.parameters():
            if id(p) in streamed:  # not resident: named on its own below
                continue
            n = p.numel() * p.element_size()
            if hasattr(p, "gguf_qtype"):
                blocks += n
            elif p.is_mkldnn:
                onednn += n  # bf16/fp16 weights in oneDNN's layout (layers/quantization/onednn_pack.py)
            elif p.is_floating_point():
                floats += n
            else:
                packed += n  # int8 / int4 / GPTQ / AWQ / fp8 words
        kinds = [f"GGUF blocks {blocks / MiB:.1f}"] if blocks else []
        kinds += [f"packed {packed / MiB:.1f}"] if packed else []
        kinds += [f"float packed for oneDNN {onednn / MiB:.1f}"] if onednn else []
        if is_gguf(self.config.model.model):
            from tokenmill.model.gguf_loader import dequantized_at_load

            why = dequantized_at_load(self.config.model.model, self.hf_config, _ResidentParameters(model, streamed),
                                      quant, self.config.model.quantization)
            dequantized = sum(why.values())
            kinds.append(f"float as stored {(floats - dequantized) / MiB:.1f}")
            kinds.append(f"dequantized at load {dequantized / MiB:.1f}" + (
                " [" + ", ".join(f"{r}: {b / MiB:.1f}" for r, b in sorted(why.items())) + "]" if why else ""))
        else:
            kinds.append(f"float {floats / MiB:.1f}")
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        caches = self.runner.kv_caches()
        reserved = sum(t.numel() * t.element_size() for t in caches)
        touched = resident_bytes(caches) if self.device.type == "cpu" else None
        kv = f"KV cache {reserved / MiB:.1f} MiB reserved, " + (
            f"{touched / MiB:.1f} MiB touched (pages are touched as blocks are first written)" if touched is not None
            else f"on {self.device}" if self.device.type != "cpu" else "touched unknown")
        mem = process_memory()
        rss = (f"process RSS {mem['rss'] / MiB:.0f} MiB (anonymous {mem['anonymous'] / MiB:.0f}, "
               f"file-backed {mem['file'] / MiB:.0f})" if mem else "process RSS unknown")
        where = (f" (and {sum(streamed.values()) / MiB:.1f} MiB {streamed_where(model.weight_store.describe())})"
                 if streamed else "")
        log.info("resident: weights %.1f MiB on %s (%s)%s, buffers %.1f MiB; %s; %s",
                 (blocks + packed + floats + onednn) / MiB, self.device, ", ".join(kinds), where, buffers / MiB, kv, rss)

    def model_cost(self):
        from tokenmill.diagnostics import ModelCost

        return ModelCost.from_model(self.runner.model, self.hf_config, self.runner.kv_dtype)

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

    def _graph_shapes(self) -> tuple[int, int, tuple[int, ...]]:
        """What the graphs are captured for: up to max_num_seqs requests, block tables as wide as the longest
        request's (drafts' slots included), 1 token per request, and k + 1 with k drafts per step."""
        cache, sched, spec = self.config.cache, self.config.scheduler, self.config.speculative
        max_blocks = -(-(self.max_model_len + sched.num_lookahead_tokens) // cache.block_size)
        k = spec.num_speculative_tokens if spec is not None else 0
        return sched.max_num_seqs, max_blocks, (1, k + 1) if k else (1,)

    def _graph_bytes(self) -> int:
        """What the decode graphs hold for good (their private memory pool, which eager steps cannot reuse, and
        their fixed buffers), measured by capturing them once on the profiling pool and releasing them."""
        before = torch.cuda.memory_reserved(self.device)
        self.runner.capture_graphs(*self._graph_shapes())
        held = torch.cuda.memory_reserved(self.device) - before
        self.runner.graphs = None
        return max(held, 0)

    # ---- steps ---------------------------------------------------------------------------
    def execute_model(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        return self.runner.execute_model(batch)

    def transfer_kv(self, ops: list) -> tuple[list, float]:
        """Run the KV tier ops before the step's forward; returns (failed loads, seconds)."""
        from tokenmill.core.kv_offload import LoadOp

        from tokenmill.core.kv_connector import ImportOp, PrefetchOp

        for op in ops:
            if isinstance(op, PrefetchOp):
                self.connector.prefetch(op)  # background reads: returns at once
        imports = [op for op in ops if isinstance(op, ImportOp)]
        tier_ops = [op for op in ops if not isinstance(op, (ImportOp, PrefetchOp))]
        failed, seconds = [], 0.0
        if tier_ops:
            failed = self.transfer.run(tier_ops)
            seconds = self.transfer.stats.last_ops_s
        if imports:
            t0 = time.perf_counter()
            failed += self.connector.load(imports)
            seconds += time.perf_counter() - t0
        loaded = [op.block_id for op in ops if isinstance(op, (LoadOp, ImportOp))]
        if loaded:  # written outside a forward pass: lazy zeroing must leave them be
            self.runner.mark_initialized(torch.tensor(loaded, dtype=torch.long))
        return failed, seconds

    def kv_prefetched(self, hashes: list[bytes]) -> list[bytes]:
        """Which of these handed-over blocks the background reads have finished (read or failed)."""
        return self.connector.finished(hashes)

    def export_kv(self, ops: list) -> float:
        """A KV producer's blocks computed by the step just run: write them for the decode instances.
        Returns the seconds it took."""
        t0 = time.perf_counter()
        self.connector.export(ops)
        return time.perf_counter() - t0

    def ping(self) -> str:
        return "pong"

    def release_memory(self) -> None:
        """Hand the KV pools (a draft's too) and the decode graphs back now, on LLM.close() or an engine's
        shutdown, even while something still references the model (a caller's handle on the runner kept a
        90 % pool alive and the next engine in the process found 0 blocks, docs/gpu.md): each pool's storage
        shrinks to nothing, so the runner cannot step afterwards."""
        if self.runner is None or any(a.k_cache is None for a in self.runner.attn_layers):
            return  # (init failed before the pool was allocated)
        for t in self.runner.kv_caches():
            if t.untyped_storage().resizable():  # (not a pool mapped from a file or shared memory)
                t.untyped_storage().resize_(0)
        self.runner.graphs = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def shutdown(self) -> None:
        if self.transfer is not None:
            self.transfer.close()
        self.release_memory()
        if self.distributed_init_method is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
