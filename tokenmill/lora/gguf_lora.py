"""llama.cpp's LoRA adapters (`--lora FILE.gguf`, written by convert_lora_to_gguf.py) into plain tensors.

The file says `general.type = adapter`, `adapter.type = lora` and `adapter.lora.alpha`; each adapted weight
`blk.{i}.{part}.weight` has `.lora_a` (A, [r, in]) and `.lora_b` (B, [out, r]), float or Q8_0. The scale is
alpha / r, or 1 where alpha is 0 (as llama.cpp applies it). For Llama and Mistral the converter permuted the rows
of Q and K for llama.cpp's rope layout, as it does the base weights: B of q and k is marked `rope_permuted` and put
back in transformers' order against the model's head counts (lora/manager.py).
"""
from __future__ import annotations

import numpy as np
import torch

from tokenmill.lora.peft import LoRAAdapter, LoRAFormatError, LoRAWeights
from tokenmill.model.registry import gguf_architectures, gguf_arch

# llama.cpp's names of the projections an adapter may target -> transformers' module names.
PARTS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj"}


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    value = f.parts[f.data[0]]
    if f.types and f.types[0].name == "STRING":
        return bytes(value).decode("utf-8", errors="replace")
    return value.tolist()[0] if hasattr(value, "tolist") else value


def load_gguf_lora(path: str, max_rank: int) -> LoRAAdapter:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except FileNotFoundError:
        raise LoRAFormatError(f"LoRA adapter {path!r}: no such file.") from None
    except Exception as e:  # noqa: BLE001 - the gguf reader raises assorted errors for a bad file
        raise LoRAFormatError(f"LoRA adapter {path}: not a readable GGUF file ({type(e).__name__}: {e}).") from None
    if _field(reader, "general.type") != "adapter" or _field(reader, "adapter.type") != "lora":
        raise LoRAFormatError(f"LoRA adapter {path}: a GGUF file but not a LoRA adapter (general.type "
                              f"{_field(reader, 'general.type')!r}, adapter.type {_field(reader, 'adapter.type')!r}).")
    alpha = float(_field(reader, "adapter.lora.alpha") or 0.0)
    arch = _field(reader, "general.architecture")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        base, _, which = t.name.rpartition(".")
        if which not in ("lora_a", "lora_b"):
            raise LoRAFormatError(f"LoRA adapter {path}: tensor {t.name!r} is not a lora_a / lora_b weight.")
        parts = base.split(".")
        if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit() or parts[3] != "weight":
            raise LoRAFormatError(f"LoRA adapter {path}: tensor {t.name!r} does not adapt a layer's weight.")
        hf_part = PARTS.get(parts[2])
        if hf_part is None:
            raise LoRAFormatError(f"LoRA adapter {path}: {parts[2]} is not a supported target "
                                  f"({', '.join(PARTS)}).")
        try:
            w = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.tensor_type))
        except (NotImplementedError, ValueError) as e:
            raise LoRAFormatError(f"LoRA adapter {path}: tensor {t.name} cannot be read ({e}).") from None
        w = np.ascontiguousarray(w).reshape(tuple(int(d) for d in reversed(t.shape)))
        module = f"model.layers.{parts[1]}.{hf_part}"
        pairs.setdefault(module, {})[which] = torch.from_numpy(w.astype(np.float32))
    if not pairs:
        raise LoRAFormatError(f"LoRA adapter {path}: no lora_a / lora_b tensors.")
    # Q/K rows in llama.cpp's rope order where its family's layout permuted them (model/gguf_arch.py).
    permuted = arch in gguf_architectures() and gguf_arch(arch).permuted_qk
    adapter = LoRAAdapter(path, 0, rope_permuted=permuted)
    for module, ab in pairs.items():
        if set(ab) != {"lora_a", "lora_b"}:
            raise LoRAFormatError(f"LoRA adapter {path}: {module} has {next(iter(ab))} without its pair.")
        a, b = ab["lora_a"], ab["lora_b"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoRAFormatError(f"LoRA adapter {path}: {module} lora_a {tuple(a.shape)} and lora_b "
                                  f"{tuple(b.shape)} disagree on the rank.")
        r = a.shape[0]
        if r > max_rank:
            raise LoRAFormatError(f"LoRA adapter {path}: {module} has rank {r}, above --max-lora-rank {max_rank}.")
        scale = alpha / r if alpha else 1.0
        adapter.modules[module] = LoRAWeights(a.contiguous(), (b * scale).contiguous())
    adapter.rank = max(w.rank for w in adapter.modules.values())
    return adapter
