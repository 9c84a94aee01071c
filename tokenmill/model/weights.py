"""The one weight loader: (checkpoint name, full tensor) pairs into a model's parameters.

A model class declares, as data:
- `packed_modules_mapping`: fused module -> the checkpoint modules packed into it, in shard order,
  e.g. {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}; the
  fused layer's `shard_ids` name the shards in that order ("q"/"k"/"v", or 0, 1, ...);
- `weight_naming`: a WeightNaming that maps checkpoint names onto parameter names.
Expert tensors (`...experts.{e}.gate_proj.weight`, or merged `...experts.gate_proj.weight`) go to the
FusedMoE's stacked parameters with shard id (expert, "w1"|"w3"|"w2") (layers/moe.py `expert_target`).
Each parameter's `weight_loader(param, tensor, shard_id=None)` cuts out this rank's shard and puts it
in place; parameters without one take the tensor whole. Afterwards every layer's quant method gets
`process_weights_after_loading`; a method that packs a float weight at load (int8/int4, and every FusedMoE)
gets it as soon as its layer's last tensor is in, so the float copy of the whole model is never resident at
once, and `pages` (model/mapped_pages.py) gives back the file pages that such a layer no longer uses.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from tokenmill.layers.attention_backends.kv_quant import KV_SCALE_NAMES, load_kv_scale
from tokenmill.layers.linear import LinearBase, default_weight_loader
from tokenmill.layers.moe import FusedMoE, expert_target
from tokenmill.layers.quantization.base import weight_attr
from tokenmill.model.mapped_pages import RECLAIM_EVERY, MappedPages, trim_heap


@dataclass(frozen=True)
class WeightNaming:
    strip_prefixes: tuple[str, ...] = ("model.",)
    skip_substrings: tuple[str, ...] = ("rotary_emb.",)  # inv_freq buffers some old checkpoints saved
    tied_names: tuple[str, ...] = ("lm_head.weight",)  # skipped when the model ties its embeddings

    def param_name(self, name: str, tied: bool) -> str | None:
        """The model-side name of a checkpoint tensor (before unpacking), or None to skip it."""
        for prefix in self.strip_prefixes:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        if any(s in name for s in self.skip_substrings) or (tied and name in self.tied_names):
            return None
        return name


# What load_weights assumes of a module that does not declare it: no renaming, no packing, no tied head.
_UNDECLARED = {"weight_naming": WeightNaming(), "packed_modules_mapping": {}, "tie_word_embeddings": False}


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 pages: MappedPages | None = None) -> None:
    """Load every tensor; fail naming the checkpoint tensors that are missing or have the wrong shape.
    `pages`: the tracker of the file mapping `weights` come from, released as layers are packed."""
    # getattr: model is any nn.Module loaded here (decoders, draft heads, the tests' toy modules); only some
    # declare what the module docstring lists (and tie_word_embeddings), the others get these defaults
    declared = {k: getattr(model, k, v) for k, v in _UNDECLARED.items()}
    naming: WeightNaming = declared["weight_naming"]
    packed: dict[str, list[str]] = declared["packed_modules_mapping"]
    unpacked = {part: (fused, i) for fused, parts in packed.items() for i, part in enumerate(parts)}
    tied = bool(declared["tie_word_embeddings"])
    params = dict(model.named_parameters())
    expected = _expected_names(params, packed)
    early = _EarlyPacking(model, params, packed)
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        name = naming.param_name(ckpt_name, tied)
        if name is None:
            continue
        parent, part, leaf = _split(name)
        if leaf in KV_SCALE_NAMES:  # fp8 KV cache scales of FP8 checkpoints: not parameters
            load_kv_scale(model, _join(parent, part), leaf, tensor)
            continue
        shard_id = None
        target = name
        expert = expert_target(name) if name not in params and ".experts." in name else None
        if expert is not None and expert[0] in params:  # one expert's tensor (or all experts') into FusedMoE
            target, shard_id = expert
            name = target
        elif name not in params and part in unpacked:
            fused, index = unpacked[part]
            module_name = _join(parent, fused)
            target = f"{module_name}.{leaf}"
            if target in params:
                shard_id = model.get_submodule(module_name).shard_ids[index]
        param = params.get(target)
        if param is None:
            continue  # unused extras
        loader = weight_attr(param, "weight_loader", default_weight_loader)  # set on some layers' parameters only
        try:
            loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"weight {ckpt_name} {e}") from None
        loaded.add(name)
        del param, tensor  # a packed layer's float weight must not outlive its packing here
        if early.loaded(name) and early.unreturned >= RECLAIM_EVERY:
            trim_heap()  # the packed layers' float weights, freed into the heap: back to the system
            early.unreturned = 0
        if pages is not None and pages.due():
            pages.release(model)  # and the file pages they were read from
    missing = sorted(expected - loaded)
    missing += [n for m in model.modules() if isinstance(m, FusedMoE) for n in m.unloaded()]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing weight tensors: {shown}")
    for module in model.modules():
        if isinstance(module, (LinearBase, FusedMoE)) and not early.done(module):  # the layers with a quant method
            module.quant_method.process_weights_after_loading(module)
    if pages is not None:
        pages.release(model)


class _EarlyPacking:
    """Layers whose quant method packs the float weight at load (`process_when_loaded`) and FusedMoE layers,
    processed as soon as their last checkpoint tensor is in: the float weights of one layer at a time are
    resident, not the whole model's. Their parameters leave the loader's table then (its reference would
    keep the float weight alive)."""

    def __init__(self, model: nn.Module, params: dict[str, torch.Tensor], packed: dict[str, list[str]]) -> None:
        self._params = params
        self._by_module: dict[str, list[str]] = {}  # module name -> its parameters' names
        for pname in params:
            self._by_module.setdefault(pname.rpartition(".")[0], []).append(pname)
        self._waiting: dict[str, set[str]] = {}  # linear layer -> checkpoint-side names not loaded yet
        self._owner: dict[str, str] = {}  # checkpoint-side name (a FusedMoE's: its parameter name) -> module
        self._modules: dict[str, nn.Module] = {}
        self._done: set[int] = set()
        self.unreturned = 0  # float bytes freed by packing since the heap was last trimmed
        for module_name, module in model.named_modules():
            pnames = self._by_module.get(module_name)
            if not pnames:
                continue
            if isinstance(module, FusedMoE):
                self._owner.update((p, module_name) for p in pnames)
            elif isinstance(module, LinearBase) and module.quant_method.process_when_loaded:
                names = _expected_names({p: params[p] for p in pnames}, packed)
                self._waiting[module_name] = set(names)
                self._owner.update((n, module_name) for n in names)
            else:
                continue
            self._modules[module_name] = module

    def loaded(self, name: str) -> bool:
        """`name` (checkpoint side) is in; True when that completed a layer, now packed."""
        module_name = self._owner.get(name)
        if module_name is None:
            return False
        module = self._modules[module_name]
        if id(module) in self._done:
            return False
        if isinstance(module, FusedMoE):
            if not module.complete():
                return False
        else:
            waiting = self._waiting[module_name]
            waiting.discard(name)
            if waiting:
                return False
        floats = [self._params.pop(p, None) for p in self._by_module[module_name]]
        self.unreturned += sum(t.numel() * t.element_size() for t in floats if t is not None)
        del floats
        module.quant_method.process_weights_after_loading(module)
        self._done.add(id(module))
        return True

    def done(self, module: nn.Module) -> bool:
        return id(module) in self._done


def _expected_names(params: dict[str, torch.Tensor], packed: dict[str, list[str]]) -> set[str]:
    """Parameter names as the checkpoint spells them (less the stripped prefix): a packed parameter
    stands for its parts (layers.0.self_attn.k_proj.weight, not qkv_proj.weight)."""
    names: set[str] = set()
    for pname in params:
        parent, module, leaf = _split(pname)
        if module in packed:
            names.update(f"{_join(parent, part)}.{leaf}" for part in packed[module])
        else:
            names.add(pname)
    return names


def _split(name: str) -> tuple[str, str, str]:
    """"layers.0.mlp.up_proj.weight" -> ("layers.0.mlp", "up_proj", "weight")."""
    module, _, leaf = name.rpartition(".")
    parent, _, last = module.rpartition(".")
    return parent, last, leaf


def _join(parent: str, module: str) -> str:
    return f"{parent}.{module}" if parent else module
