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
`process_weights_after_loading`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from tokenmill.layers.attention_backends.kv_quant import KV_SCALE_NAMES, load_kv_scale
from tokenmill.layers.linear import default_weight_loader
from tokenmill.layers.moe import FusedMoE, expert_target


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


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load every tensor; fail naming the checkpoint tensors that are missing or have the wrong shape."""
    naming: WeightNaming = getattr(model, "weight_naming", WeightNaming())
    packed: dict[str, list[str]] = getattr(model, "packed_modules_mapping", {})
    unpacked = {part: (fused, i) for fused, parts in packed.items() for i, part in enumerate(parts)}
    tied = bool(getattr(model, "tie_word_embeddings", False))
    params = dict(model.named_parameters())
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
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"weight {ckpt_name} {e}") from None
        loaded.add(name)
    missing = sorted(_expected_names(params, packed) - loaded)
    missing += [n for m in model.modules() if isinstance(m, FusedMoE) for n in m.unloaded()]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing weight tensors: {shown}")
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)


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
