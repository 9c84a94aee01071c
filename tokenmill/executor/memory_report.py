"""The worker's start-up line on what the process holds after loading: weight bytes by kind, buffers, the KV
pool reserved and touched, and the process RSS."""
from __future__ import annotations

import logging

import torch

from tokenmill.config import EngineConfig

# The worker's log: its start-up lines keep one name whichever stage writes them.
log = logging.getLogger("tokenmill.executor.worker")


class _ResidentParameters:
    """A model as seen through its resident parameters only (those not in `skip`, by id), for the start-up log's
    GGUF breakdown: the streamed ones are counted on their own."""

    def __init__(self, model: torch.nn.Module, skip: dict[int, int]) -> None:
        self.model, self.skip = model, skip

    def named_parameters(self):
        return ((n, p) for n, p in self.model.named_parameters() if id(p) not in self.skip)

    def __getattr__(self, name: str):
        return getattr(self.model, name)  # delegation: any attribute of the wrapped model


def log_resident_memory(config: EngineConfig, hf_config, model: torch.nn.Module, quant,
                        caches: list[torch.Tensor], device: torch.device) -> None:
    """One INFO line on what this process holds after loading: weight bytes by kind (GGUF blocks, packed,
    float; the float ones dequantized from a quantized GGUF tensor with the reason), model buffers, the KV
    pool (`caches`) reserved vs touched (a CPU pool is never pre-zeroed, so its pages cost RSS only once a block
    is written) and the process RSS."""
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
    if is_gguf(config.model.model):
        from tokenmill.model.gguf_loader import dequantized_at_load

        why = dequantized_at_load(config.model.model, hf_config, _ResidentParameters(model, streamed),
                                  quant, config.model.quantization)
        dequantized = sum(why.values())
        kinds.append(f"float as stored {(floats - dequantized) / MiB:.1f}")
        kinds.append(f"dequantized at load {dequantized / MiB:.1f}" + (
            " [" + ", ".join(f"{r}: {b / MiB:.1f}" for r, b in sorted(why.items())) + "]" if why else ""))
    else:
        kinds.append(f"float {floats / MiB:.1f}")
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    reserved = sum(t.numel() * t.element_size() for t in caches)
    touched = resident_bytes(caches) if device.type == "cpu" else None
    kv = f"KV cache {reserved / MiB:.1f} MiB reserved, " + (
        f"{touched / MiB:.1f} MiB touched (pages are touched as blocks are first written)" if touched is not None
        else f"on {device}" if device.type != "cpu" else "touched unknown")
    mem = process_memory()
    rss = (f"process RSS {mem['rss'] / MiB:.0f} MiB (anonymous {mem['anonymous'] / MiB:.0f}, "
           f"file-backed {mem['file'] / MiB:.0f})" if mem else "process RSS unknown")
    where = (f" (and {sum(streamed.values()) / MiB:.1f} MiB {streamed_where(model.weight_store.describe())})"
             if streamed else "")
    log.info("resident: weights %.1f MiB on %s (%s)%s, buffers %.1f MiB; %s; %s",
             (blocks + packed + floats + onednn) / MiB, device, ", ".join(kinds), where, buffers / MiB, kv, rss)
