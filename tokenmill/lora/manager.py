"""The worker's adapters: a host cache of loaded adapters (LRU, `max_cpu_loras`) and `max_loras` device slots in
every adapted layer (LRU among the adapters the step does not use). Each step it makes sure the step's adapters
are in slots and tells the layers which tokens use which slot (layers/lora.py). The scheduler never puts more
distinct adapters in one step than there are slots (core/scheduler.py).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from tokenmill.layers.linear import LinearBase
from tokenmill.layers.lora import LoRALayer, LoRAStep
from tokenmill.lora.peft import (LAYER_INDEX, TARGETS, LoRAAdapter, LoRAFormatError, check_module_shape, check_shapes,
                                 load_peft)
from tokenmill.lora.request import LoRARequest
from tokenmill.model.gguf_loader import unpermute_rope_rows

if TYPE_CHECKING:
    from tokenmill.model.blocks import DecoderForCausalLM

log = logging.getLogger(__name__)

# Per adapted layer: per shard, this rank's (A, B), or None where the adapter leaves the shard alone.
Resolved = dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]]


def load_adapter(req: LoRARequest, max_rank: int) -> LoRAAdapter:
    """Read an adapter in any supported format (a GGUF LoRA file or a PEFT folder)."""
    if req.lora_path.endswith(".gguf"):
        from tokenmill.lora.gguf_lora import load_gguf_lora

        return load_gguf_lora(req.lora_path, max_rank)
    return load_peft(req.lora_path, max_rank)


class AdapterTargets:
    """Where each checkpoint module of an adapter lands in a model: (layer name, shard), with the shapes it
    must have. Built from the model alone, so the API process can check an adapter without the weights."""

    def __init__(self, model: DecoderForCausalLM) -> None:
        self.naming = model.weight_naming
        packed = self.packed = model.packed_modules_mapping
        self.unpacked = {part: (fused, i) for fused, parts in packed.items() for i, part in enumerate(parts)}
        names = {part for part in TARGETS if part not in self.unpacked} | {f for f, _ in self.unpacked.values()}
        self.layers: dict[str, LinearBase] = {
            name: m for name, m in model.named_modules()
            if isinstance(m, LinearBase) and name.rsplit(".", 1)[-1] in names}
        # Layer indices present in the model but not on this pipeline stage: an adapter's modules there are
        # another stage's to load.
        self.num_layers = len(model.layers)
        # checkpoint suffix (q_proj, ...) -> the full (in, out) of each layer of that name
        self.shapes: dict[str, list[tuple[int, int]]] = {}
        for name, layer in self.layers.items():
            suffix = name.rsplit(".", 1)[-1]
            for part, shape in self._checkpoint_shapes(suffix, layer):
                if shape not in self.shapes.setdefault(part, []):
                    self.shapes[part].append(shape)

    def _checkpoint_shapes(self, suffix: str, layer: LinearBase) -> list[tuple[str, tuple[int, int]]]:
        """(checkpoint module suffix, full (in, out)) of what an adapter targets in this layer: each packed part,
        or, where the checkpoint itself stores the layer fused (Phi-3's qkv_proj, GLM-4's gate_up_proj), the
        whole layer (its shards' outputs stacked)."""
        shards = layer.lora_shapes()
        parts = self.packed.get(suffix)
        if parts is not None:
            return list(zip(parts, shards))
        return [(suffix, (shards[0][0], sum(n_out for _, n_out in shards)))]

    def locate(self, module: str) -> tuple[str, int] | None:
        """A checkpoint module name -> (this model's layer name, shard index); None if not on this rank."""
        name = self.naming.param_name(module + ".weight", tied=False) or ""
        name = name.removesuffix(".weight")
        prefix, _, part = name.rpartition(".")
        if part in self.unpacked:
            fused, shard = self.unpacked[part]
            name = f"{prefix}.{fused}" if prefix else fused
        else:
            shard = 0
        return (name, shard) if name in self.layers else None

    def resolve(self, adapter: LoRAAdapter) -> Resolved:
        """Map and cut an adapter for this rank, checking every shape; raises LoRAFormatError naming the module."""
        check_shapes(adapter, self.shapes, self.num_layers)
        out: Resolved = {}
        for module, w in adapter.modules.items():
            where = self.locate(module)
            if where is None:
                if LAYER_INDEX.search(module):
                    continue  # a layer of another pipeline stage
                raise LoRAFormatError(f"LoRA adapter {adapter.path}: module {module} is not in this model.")
            name, shard = where
            layer = self.layers[name]
            b = w.b
            part = module.rsplit(".", 1)[-1]
            suffix = name.rsplit(".", 1)[-1]
            check_module_shape(adapter, module, w, [s for p, s in self._checkpoint_shapes(suffix, layer) if p == part])
            if adapter.rope_permuted and part in ("q_proj", "k_proj"):
                b = unpermute_rope_rows(b, layer.total_num_heads if part == "q_proj" else layer.total_num_kv_heads)
            shards = layer.lora_shapes()
            parts = out.setdefault(name, [None] * len(shards))
            if suffix == part and len(shards) > 1:
                # The whole fused layer adapted by one (A, B): each shard gets A and its own rows of B (the
                # delta x A^T B_s^T of shard s; A is multiplied once per shard, the price of the shared slots).
                rows = b.split([n_out for _, n_out in shards])
                for s, b_s in enumerate(rows):
                    parts[s] = layer.lora_cut(s, w.a, b_s)
            else:
                parts[shard] = layer.lora_cut(shard, w.a, b)
        return out


class LoRAManager:
    def __init__(self, model: DecoderForCausalLM, max_loras: int, max_rank: int, max_cpu_loras: int,
                 device: torch.device) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.device = device
        self.targets = AdapterTargets(model)
        self.step = LoRAStep()
        for layer in self.targets.layers.values():
            layer.lora = LoRALayer(layer, self.step, max_loras, max_rank, model.compute_dtype, device)
        model.lora_step = self.step  # the model keeps its native stack for steps without adapter tokens
        self.host: OrderedDict[tuple, Resolved] = OrderedDict()  # cache_key -> resolved, LRU order
        self.slots: list[tuple | None] = [None] * max_loras  # cache_key per slot
        self.slot_lru: OrderedDict[int, None] = OrderedDict((i, None) for i in range(max_loras))
        self.loads = 0  # adapters read from disk
        self.swaps = 0  # adapters put in a slot

    @property
    def nbytes(self) -> int:
        return sum(layer.lora.nbytes for layer in self.targets.layers.values())

    def _host(self, req: LoRARequest) -> Resolved:
        key = req.cache_key
        resolved = self.host.get(key)
        if resolved is not None:
            self.host.move_to_end(key)
            return resolved
        resolved = self.targets.resolve(load_adapter(req, self.max_rank))
        self.loads += 1
        self.host[key] = resolved
        while len(self.host) > self.max_cpu_loras:
            old, _ = self.host.popitem(last=False)
            log.debug("LoRA host cache: dropped %s", old)
        return resolved

    def _slot_for(self, req: LoRARequest, busy: set[int]) -> int:
        key = req.cache_key
        if key in self.slots:
            slot = self.slots.index(key)
        else:
            resolved = self._host(req)  # may raise: before any slot changes
            free = [i for i in self.slot_lru if i not in busy]
            if not free:
                raise RuntimeError(f"more adapters in one step than --max-loras {self.max_loras}")
            empty = [i for i in free if self.slots[i] is None]
            slot = empty[0] if empty else free[0]
            for name, layer in self.targets.layers.items():
                parts = resolved.get(name)
                if parts is None:
                    layer.lora.clear(slot)
                else:
                    layer.lora.set(slot, parts)
            self.slots[slot] = key
            self.swaps += 1
        self.slot_lru.move_to_end(slot)
        return slot

    def prepare(self, requests: list, num_tokens: list[int]) -> None:
        """Slots for this step's adapters, and the runs of tokens each one applies to (requests in batch order,
        each with num_tokens of its own)."""
        runs, start, busy = [], 0, set()
        slot_of: dict[tuple, int] = {}
        for r, n in zip(requests, num_tokens):
            lora = r.lora
            if lora is not None:
                slot = slot_of.get(lora.cache_key)
                if slot is None:
                    slot = slot_of[lora.cache_key] = self._slot_for(lora, busy)
                    busy.add(slot)
                runs.append((slot, start, start + n))
            start += n
        self.step.set(runs, start, self.device)
