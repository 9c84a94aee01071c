"""The worker's model: the quantization chosen (a flag's, or a pre-quantized checkpoint's), this rank's shard
loaded, the layers beyond a resident budget streamed or offloaded to the host, and the weights' log line."""
from __future__ import annotations

import contextlib
import logging

import torch

from tokenmill import huge_pages
from tokenmill.config import EngineConfig
from tokenmill.layers.quantization.base import QuantizationConfig

# The worker's log: its start-up lines keep one name whichever stage writes them.
log = logging.getLogger("tokenmill.executor.worker")


def load_worker_model(config: EngineConfig, device: torch.device, rank: int):
    """This rank's shard of the model. Returns (model, hf_config, max_model_len, quant: its QuantizationConfig
    or None)."""
    from tokenmill.layers.quantization import get_quantization_config
    from tokenmill.model.loader import load_model

    mc, par = config.model, config.parallel
    quant = get_quantization_config(mc.quantization, mc.quantization_group_size, model=mc.model, device=str(device),
                                    activations=mc.activation_quantization, batch_dtype=mc.quantized_batch_dtype)
    tp, cp = par.tensor_parallel_size, par.context_parallel_size
    model_rank = rank // cp  # context-parallel ranks hold the same weights (innermost in the rank order)
    # Layers that will stream from disk must not leave their pages in a shared huge-page arena (huge_pages.py).
    streamed = mc.weights_resident_gb is not None
    with huge_pages.separate_mappings() if streamed else contextlib.nullcontext():
        model, hf_config, max_model_len = load_model(mc.model, mc.dtype, mc.max_model_len, str(device),
                                                     quant_config=quant, tp_rank=model_rank % tp, tp_size=tp,
                                                     expert_parallel=par.enable_expert_parallel,
                                                     pp_rank=model_rank // tp, pp_size=par.pipeline_parallel_size)
    # getattr: a model loaded from a pre-quantized checkpoint carries its QuantizationConfig (from config.json)
    quant = getattr(model, "quant_config", quant)
    if mc.weights_resident_gb is not None:  # the layers beyond the budget stream from disk (model/weight_store.py)
        from tokenmill.model.weight_store import WeightStore

        WeightStore.attach(model, int(mc.weights_resident_gb * 2**30), mc.weights_stream_dir)
    if mc.cpu_offload_gb:  # layers holding that many bytes live in host memory (model/host_offload.py)
        from tokenmill.model.host_offload import HostOffload

        HostOffload.attach(model, int(mc.cpu_offload_gb * 2**30), device)
    log_weights(config, model, quant)
    return model, hf_config, max_model_len, quant


def log_weights(config: EngineConfig, model: torch.nn.Module, quant: QuantizationConfig | None) -> None:
    """The weights' line: resident bytes, streamed ones, the format and its activation path."""
    from tokenmill import native
    from tokenmill.diagnostics import resident_weight_bytes, streamed_parameters, streamed_where

    mc = config.model
    x8 = quant is not None and quant.int8_activations
    how = ""
    if x8:
        path = "per token, torch._int_mm" if quant.per_token_activations else native.int8_dot_path()
        how = f", int8 activations: {path}"
    bf16 = quant is not None and quant.name == "gguf" and mc.quantized_batch_dtype == "bfloat16"
    if bf16:
        how += ", batches of 32+ rows in bf16"
        from tokenmill.platform import cpu_supports

        if not cpu_supports(torch.bfloat16):  # (GGUF blocks are kept on the CPU only)
            log.warning("--quantized-batch-dtype bfloat16: this CPU has neither AVX-512 BF16 nor AMX-BF16, so bf16 "
                        "GEMMs are emulated and prompts run slower than with float32 (the default)")
    # Streamed weights are not resident: counting them here contradicted the store's own line above.
    streamed = sum(p.numel() * p.element_size() for p in streamed_parameters(model))
    log.info("weights: %.1f MiB resident%s%s", (resident_weight_bytes(model) - streamed) / 2**20,
             f", {streamed / 2**20:.1f} MiB {streamed_where(model.weight_store.describe())}" if streamed else "",
             f" ({quant.name}{how})" if quant else "")
    if mc.activation_quantization != "none" and not x8:
        log.warning("--activation-quantization %s acts on gguf, int8 and int4 weights; with %s weights "
                    "activations stay float32", mc.activation_quantization, quant.name if quant else "float")
    if mc.quantized_batch_dtype != "float32" and not bf16:
        log.warning("--quantized-batch-dtype %s acts on GGUF block weights kept as blocks; with %s weights batches "
                    "stay as they are", mc.quantized_batch_dtype, quant.name if quant else "float")
