"""PEFT LoRA adapters: `adapter_config.json` + `adapter_model.safetensors` (or `.bin`) into plain tensors.

An adapter adds to a linear layer W the product B A scaled by alpha / r (alpha / sqrt(r) with rsLoRA): y = x W^T +
scaling * (x A^T) B^T, A [r, in], B [out, r]. The scaling is folded into B here, once. Everything PEFT can save
that this engine does not compute (DoRA, biases, modules_to_save, per-module rank/alpha patterns, Conv1D's
fan_in_fan_out) is refused with the file and the reason; nothing is half-loaded.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

# The projections an adapter may target, by their checkpoint names: Llama's seven (every family but Phi-3 has
# some of them), the fused qkv_proj / gate_up_proj of checkpoints that store them fused (Phi-3; GLM-4's
# gate_up_proj), and MLA's linear projections (DeepSeek-V2/V3). A model checks an adapter's targets against the
# layers it has (lora/manager.py).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj",
           "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")
# Targets PEFT can adapt that this engine cannot compute, with why.
REFUSED = {
    "kv_b_proj": "MLA's kv_b_proj is never run as a linear layer: the absorbed attention multiplies queries and "
                 "outputs by its per-head blocks, so a low-rank delta on it has no place to be added",
    # gpt-oss's MoE block as transformers has it: no nn.Linear inside, so an adapter naming these was written by
    # hand or by another tool (PEFT's form is target_parameters, refused in check_config).
    "router": "a MoE router (gpt-oss's mlp.router) only picks each token's experts; LoRA on it has no path here",
    "experts": "a MoE layer's experts are fused [experts, in, out] tensors, not linear layers; LoRA on them has no "
               "path here",
}
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[A-Za-z0-9_]+)?\.weight$")


class LoRAFormatError(ValueError):
    """The adapter cannot be served; the message names the file and the reason."""


@dataclass
class LoRAWeights:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r], scaling folded in

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoRAAdapter:
    """One adapter's weights by checkpoint module name (e.g. "model.layers.0.self_attn.q_proj")."""

    path: str
    rank: int
    modules: dict[str, LoRAWeights] = field(default_factory=dict)
    # GGUF adapters of Llama / Mistral: B of q and k has its rows in llama.cpp's rope order (lora/gguf_lora.py)
    rope_permuted: bool = False

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.modules.values())


LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


def check_shapes(adapter: LoRAAdapter, shapes: dict[str, list[tuple[int, int]]], num_layers: int) -> None:
    """Every module against the base model: a projection it has, a layer index it has, A [r, in] and B [out, r]
    of one of its sizes (`shapes`: checkpoint suffix -> full (in, out) of each layer of that name: DeepSeek's
    dense MLP and shared experts are both gate_proj, of different widths; the worker checks the very layer).
    Raises LoRAFormatError naming the module."""
    for module, w in adapter.modules.items():
        part = module.rsplit(".", 1)[-1]
        want = shapes.get(part)
        if want is None:
            raise LoRAFormatError(f"LoRA adapter {adapter.path}: {module} targets {part}, which this model does "
                                  "not have.")
        m = LAYER_INDEX.search(module)
        if m is not None and int(m.group(1)) >= num_layers:
            raise LoRAFormatError(f"LoRA adapter {adapter.path}: {module} is layer {m.group(1)}; the model has "
                                  f"{num_layers} (an adapter for another base model?).")
        check_module_shape(adapter, module, w, [tuple(s) for s in want])


def check_module_shape(adapter: LoRAAdapter, module: str, w: LoRAWeights, want: list[tuple[int, int]]) -> None:
    if (w.a.shape[1], w.b.shape[0]) not in want:
        needs = " or ".join(f"[r, {n_in}] and [{n_out}, r]" for n_in, n_out in want)
        raise LoRAFormatError(
            f"LoRA adapter {adapter.path}: {module} has lora_A {tuple(w.a.shape)} and lora_B {tuple(w.b.shape)}; "
            f"this model's {module.rsplit('.', 1)[-1]} needs {needs} (an adapter for another base model?).")


def read_config(path: str) -> dict:
    cfg_file = os.path.join(path, "adapter_config.json")
    if not os.path.isdir(path):
        raise LoRAFormatError(f"LoRA adapter {path!r}: no such folder.")
    try:
        with open(cfg_file) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise LoRAFormatError(f"LoRA adapter {path!r}: no adapter_config.json (not a PEFT adapter folder).") from None
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAFormatError(f"LoRA adapter {cfg_file}: unreadable ({e}).") from None
    if not isinstance(cfg, dict):
        raise LoRAFormatError(f"LoRA adapter {cfg_file}: not a JSON object.")
    return cfg


def check_config(cfg: dict, where: str, max_rank: int) -> None:
    def refuse(reason: str) -> None:
        raise LoRAFormatError(f"LoRA adapter {where}: {reason}.")

    if cfg.get("peft_type", "LORA") != "LORA":
        refuse(f"peft_type {cfg.get('peft_type')!r} is not LORA")
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        refuse(f"r must be a positive int, got {r!r}")
    if r > max_rank:
        refuse(f"rank {r} is above --max-lora-rank {max_rank}")
    if not isinstance(cfg.get("lora_alpha", r), (int, float)):
        refuse(f"lora_alpha must be a number, got {cfg.get('lora_alpha')!r}")
    if cfg.get("use_dora"):
        refuse("DoRA (use_dora) is not supported")
    if cfg.get("modules_to_save"):
        refuse(f"modules_to_save {cfg['modules_to_save']} is not supported (it replaces whole base modules)")
    if cfg.get("bias", "none") != "none":
        refuse(f"bias {cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("fan_in_fan_out"):
        refuse("fan_in_fan_out (Conv1D layers) is not supported")
    if cfg.get("target_parameters"):
        refuse(f"target_parameters {cfg['target_parameters']} (LoRA on bare weights rather than linear layers: "
               "PEFT's form for a MoE layer's fused expert weights, as it saves gpt-oss's mlp.experts.gate_up_proj / "
               "down_proj and the gate_proj / up_proj / down_proj targets of other MoE models, and for gpt-oss's "
               "router weight) is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            refuse(f"{key} (per-module ranks or alphas) is not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        for t in targets:
            if t.rsplit(".", 1)[-1] in REFUSED:
                refuse(f"target module {t!r} is not supported ({REFUSED[t.rsplit('.', 1)[-1]]})")
        unknown = sorted(set(t.rsplit(".", 1)[-1] for t in targets) - set(TARGETS))
        if unknown:
            refuse(f"target modules {unknown} are not supported (supported: {', '.join(TARGETS)})")


def scaling(cfg: dict) -> float:
    r = cfg["r"]
    alpha = cfg.get("lora_alpha", r)
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.exists(st):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(st)
        except (SafetensorError, OSError, ValueError) as e:
            raise LoRAFormatError(f"LoRA adapter {st}: unreadable ({e}).") from None
    pt = os.path.join(path, "adapter_model.bin")
    if os.path.exists(pt):
        try:
            return torch.load(pt, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure is the file's
            raise LoRAFormatError(f"LoRA adapter {pt}: unreadable ({e}).") from None
    raise LoRAFormatError(f"LoRA adapter {path!r}: no adapter_model.safetensors or adapter_model.bin.")


def load_peft(path: str, max_rank: int) -> LoRAAdapter:
    """Read and check a PEFT LoRA folder. Shapes against the base model are checked by the caller (lora/model.py)."""
    cfg = read_config(path)
    check_config(cfg, path, max_rank)
    scale = scaling(cfg)
    tensors = _read_tensors(path)
    where = os.path.join(path, "adapter_model.*")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAFormatError(f"LoRA adapter {where}: tensor {key!r} is not a lora_A / lora_B weight "
                                  "(embedding adapters, biases and saved modules are not supported).")
        module = m.group("module")
        if module.rsplit(".", 1)[-1] in REFUSED:
            raise LoRAFormatError(f"LoRA adapter {where}: module {module!r} is not supported "
                                  f"({REFUSED[module.rsplit('.', 1)[-1]]}).")
        if module.rsplit(".", 1)[-1] not in TARGETS:
            raise LoRAFormatError(f"LoRA adapter {where}: module {module!r} is not a supported target "
                                  f"({', '.join(TARGETS)}).")
        if t.dim() != 2 or not t.is_floating_point():
            raise LoRAFormatError(f"LoRA adapter {where}: {key} must be a 2-D float tensor, got {tuple(t.shape)} "
                                  f"{t.dtype}.")
        parts.setdefault(module, {})[m.group("which")] = t
    if not parts:
        raise LoRAFormatError(f"LoRA adapter {where}: no lora_A / lora_B tensors.")
    adapter = LoRAAdapter(path, cfg["r"])
    for module, ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise LoRAFormatError(f"LoRA adapter {where}: {module} has lora_{''.join(ab)} without its pair.")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != b.shape[1]:
            raise LoRAFormatError(f"LoRA adapter {where}: {module} lora_A {tuple(a.shape)} and lora_B "
                                  f"{tuple(b.shape)} disagree on the rank.")
        if a.shape[0] > max_rank:
            raise LoRAFormatError(f"LoRA adapter {where}: {module} has rank {a.shape[0]}, above --max-lora-rank "
                                  f"{max_rank}.")
        adapter.modules[module] = LoRAWeights(a.float().contiguous(), (b.float() * scale).contiguous())
    adapter.rank = max(w.rank for w in adapter.modules.values())
    return adapter
