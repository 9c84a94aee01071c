"""Load a GGUF file (llama.cpp's format) with the `gguf` package: hyper-parameters from its metadata,
tensors renamed to transformers' names and either kept as the file's block rows (the layers that
layers/quantization/gguf.py keeps as blocks) or dequantized (Q4_0, Q4_1, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0, F16,
BF16, F32, ...) into our dtype, and the tokenizer built from the metadata (cached after the first start).
"""
from __future__ import annotations

import hashlib
import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np
import torch

from tokenmill.model.gguf_arch import GGUFConfig, GGUFMeta, TensorJoiner
from tokenmill.model.gguf_file import GGUFFile
from tokenmill.model.hf_config import hf_get
from tokenmill.model.registry import gguf_arch, gguf_architectures

if TYPE_CHECKING:
    from tokenmill.layers.quantization.base import QuantizationConfig
    from tokenmill.model.blocks import DecoderForCausalLM

log = logging.getLogger(__name__)


@lru_cache(maxsize=4)
def read_gguf(path: str) -> GGUFFile:
    return GGUFFile(path)


def hf_config_from_gguf(path: str):
    """A transformers config equivalent to the GGUF metadata: the keys every architecture shares here, the
    family's own in its GGUFArch.config hook (registry.register_gguf, next to its model class)."""
    import transformers

    reader = read_gguf(path)
    arch = gguf_arch(reader.fields.get("general.architecture"))
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise NotImplementedError("GGUF files with precomputed rope_freqs (Llama 3.1 rope scaling) are not supported yet")
    longrope = "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors
    if longrope and not arch.longrope:
        readers = ", ".join(a for a in gguf_architectures() if gguf_arch(a).longrope)
        raise ValueError(f"GGUF architecture {arch.name!r} with LongRoPE factors (rope_factors_long/short tensors) "
                         f"is not supported by tokenmill; only {readers}'s are")
    m = GGUFMeta(arch.name, reader.fields, tensors, reader)
    num_heads = int(m("attention.head_count"))
    hidden = int(m("embedding_length"))
    embd = tensors["token_embd.weight"]
    kw = dict(
        vocab_size=int(m("vocab_size", embd.shape[-1])),
        hidden_size=hidden,
        intermediate_size=int(m("feed_forward_length") or m("expert_feed_forward_length")),
        num_hidden_layers=int(m("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(m("attention.head_count_kv", num_heads)),
        max_position_embeddings=int(m("context_length", 2048)),
        rms_norm_eps=float(m("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=reader.fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=reader.fields.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=reader.fields.get("tokenizer.ggml.padding_token_id"),
    )
    if arch.partial_rope:
        head_dim = int(m("attention.key_length") or hidden // num_heads)
    else:
        head_dim = m("attention.key_length") or m("rope.dimension_count")
    if head_dim:
        kw["head_dim"] = int(head_dim)
    rope = {"rope_type": "default", "rope_theta": float(m("rope.freq_base", 10000.0))}
    scaling = m("rope.scaling.type")
    if scaling and scaling != "none":
        rope = {"rope_type": scaling, "factor": float(m("rope.scaling.factor", 1.0)),
                "rope_theta": rope["rope_theta"]}
        if m("rope.scaling.original_context_length"):
            rope["original_max_position_embeddings"] = int(m("rope.scaling.original_context_length"))
    kw["rope_parameters"] = rope
    if m("attention.sliding_window"):
        kw["sliding_window"] = int(m("attention.sliding_window"))
    config = GGUFConfig(arch.config_class, arch.architecture, kw)
    if arch.config is not None:
        config = arch.config(m, config)
    # getattr: the transformers config class by name
    cfg = getattr(transformers, config.config_class)(**dict(config.kwargs, architectures=[config.architecture]))
    cfg.dtype = torch.float32
    cfg.gguf_architecture = arch.name
    return cfg


_LAYER_PARTS = [
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "self_attn.q_norm", "self_attn.k_norm", "input_layernorm", "post_attention_layernorm",
    "pre_feedforward_layernorm", "post_feedforward_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    "mlp.gate", "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj",  # merged [E, ...]
    "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
    "mlp.shared_expert_gate",
]
# Older llama.cpp Mixtral files: one tensor per expert, blk.N.ffn_gate.E.weight (gguf-py no longer maps them).
_LEGACY_EXPERT = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}


def _hf_names(cfg) -> list[str]:
    """transformers module names a checkpoint of the GGUF architectures may hold (generic parts; a GGUFArch's
    extra_parts settle the ones llama.cpp's map names ambiguously for it)."""
    names = ["model.embed_tokens", "model.norm", "lm_head"]
    for i in range(cfg.num_hidden_layers):
        names.extend(f"model.layers.{i}.{part}" for part in _LAYER_PARTS)
    return names


def gguf_to_hf_names(path: str, cfg) -> dict[str, str]:
    import gguf

    arch = gguf_arch(cfg.gguf_architecture)
    if arch.tensor_names is not None:
        return arch.tensor_names(cfg.num_hidden_layers)
    arch_enum = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch.name), None)
    if arch_enum is None:
        raise ValueError(f"GGUF architecture {arch.name!r}: the installed gguf package has no tensor-name map for it; "
                         "its GGUFArch must give tensor_names")
    name_map = gguf.get_tensor_name_map(arch_enum, cfg.num_hidden_layers)
    out = {}
    for hf in _hf_names(cfg):
        g = name_map.get_name(hf)
        if g is not None:
            out[f"{g}.weight"] = f"{hf}.weight"
            out[f"{g}.bias"] = f"{hf}.bias"
    for i in range(cfg.num_hidden_layers):
        for g, hf in arch.extra_parts.items():
            for kind in ("weight", "bias"):
                out[f"blk.{i}.{g}.{kind}"] = f"model.layers.{i}.{hf}.{kind}"
    # Mixtral names num_local_experts, Qwen MoE num_experts, dense models neither
    experts = hf_get(cfg, "num_local_experts") or hf_get(cfg, "num_experts") or 0
    for i in range(cfg.num_hidden_layers):
        for e in range(experts):
            for g, hf in _LEGACY_EXPERT.items():
                out[f"blk.{i}.{g}.{e}.weight"] = f"model.layers.{i}.mlp.experts.{e}.{hf}.weight"
    return out


def unpermute_rope_rows(w, n_head: int):
    """Rows of a q/k projection (numpy array or torch tensor) from llama.cpp's rope layout, each head's rotary
    halves interleaved, back to transformers' order. Also for LoRA B of q/k in GGUF adapters (lora/manager.py)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def iter_gguf_weights(path: str, cfg, dtype: torch.dtype,
                      keep_blocks: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers name, full tensor) pairs for model/weights.py's loader, which hands each to its
    parameter's weight_loader like a safetensors tensor. Tensors for which `keep_blocks(name)` holds come as
    the file's block rows (uint8 [rows, bytes per row], Q/K rows unpermuted like float rows); the rest
    are dequantized into `dtype`."""
    import gguf

    reader = read_gguf(path)
    names = gguf_to_hf_names(path, cfg)
    arch = gguf_arch(cfg.gguf_architecture)
    joiner = arch.joiner(cfg, keep_blocks is not None) if arch.joiner is not None else TensorJoiner()
    for t in reader.tensors:
        hf = names.get(t.name)
        if hf is None:
            log.debug("skipping GGUF tensor %s", t.name)
            continue
        raw = reader.raw(t)  # validated: known type, whole blocks, bytes inside the file
        kept = joiner.take_raw(hf, t.ggml_type, raw, tuple(int(d) for d in reversed(t.shape)))
        if kept is not None:  # e.g. gpt-oss's MXFP4 experts, kept MXFP4
            for name, a in kept:
                yield name, torch.from_numpy(np.ascontiguousarray(a))
            continue
        blocks = keep_blocks is not None and keep_blocks(hf)
        if blocks:
            w = raw
        else:
            try:
                w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t.ggml_type))
            except NotImplementedError as e:
                raise ValueError(f"{path}: GGUF tensor {t.name} has type {gguf.GGMLQuantizationType(t.ggml_type).name}, "
                                 f"which the gguf package cannot dequantize ({e})") from None
            w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if arch.permuted_qk:
            if ".attn_q." in t.name:
                w = unpermute_rope_rows(w, cfg.num_attention_heads)
            elif ".attn_k." in t.name:
                w = unpermute_rope_rows(w, cfg.num_key_value_heads)
        if blocks:
            # raw() read the bytes into a fresh array (an unpermute made another): the parameter takes it as is
            yield hf, torch.from_numpy(np.ascontiguousarray(w))
            continue
        if hf.endswith("shared_expert_gate.weight") and w.ndim == 1:
            w = w.reshape(1, -1)  # llama.cpp stores Qwen2-MoE's [1, hidden] gate as a vector
        if arch.norm_plus_one and t.name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's (1 + w) norm weights with the 1 added
        for hf, w in joiner.add(t.name, hf, w):  # split tensors joined back (DeepSeek's kv_b, gpt-oss's experts)
            yield hf, torch.from_numpy(np.ascontiguousarray(w)).to(dtype)
    joiner.check_done(path)


FLOAT_TYPES = {0, 1, 28, 30}  # F32, F16, F64, BF16: a float parameter from these was not dequantized


def dequantized_at_load(path: str, cfg, model: DecoderForCausalLM, quant_config: QuantizationConfig | None = None,
                        requested: str | None = None) -> dict[str, int]:
    """Bytes of the model's float parameters whose GGUF tensors were quantized, by why they were not kept as
    blocks (for the start-up log): the type has no block kernel, a merged layer's parts differ in type, or
    blocks are not kept at all (`requested`, the --quantization asked for, says whether by choice or for want
    of kernels on this device). `model`: a registered model, or a view of one (executor/memory_report.py)."""
    from tokenmill.layers.moe import expert_target
    from tokenmill.layers.quantization.gguf import KERNEL_TYPES, type_name

    params = dict(model.named_parameters())
    naming = model.weight_naming
    unpacked = {part: fused for fused, parts in model.packed_modules_mapping.items() for part in parts}
    names = gguf_to_hf_names(path, cfg)
    sources: dict[str, set[int]] = {}  # parameter -> ggml types of the GGUF tensors loaded into it
    for t in read_gguf(path).tensors:
        hf = names.get(t.name)
        pname = naming.param_name(hf, tied=False) if hf is not None else None
        if pname is None:
            continue
        if pname not in params:  # a part of a fused layer, or an expert's tensor in a FusedMoE
            module, _, leaf = pname.rpartition(".")
            parent, _, last = module.rpartition(".")
            expert = expert_target(pname) if ".experts." in pname else None
            if expert is not None:
                pname = expert[0]
            elif last in unpacked:
                pname = f"{parent}.{unpacked[last]}.{leaf}" if parent else f"{unpacked[last]}.{leaf}"
        sources.setdefault(pname, set()).add(t.ggml_type)
    quant = quant_config.name if quant_config is not None else None
    keeps = quant == "gguf"
    out: dict[str, int] = {}
    for pname, param in params.items():
        src = sources.get(pname, set())
        quantized = sorted(type_name(q) for q in src if q not in FLOAT_TYPES)
        if not param.is_floating_point() or not quantized:
            continue  # kept as blocks, or stored as float in the file (norms, biases)
        if not keeps:
            asked = quant or requested
            reason = f"--quantization {asked}" if asked else "no GGUF block kernels on this device"
        elif len(src) > 1:
            reason = f"merged layer of mixed types {'+'.join(sorted(type_name(q) for q in src))}"
        elif quantized[0] not in KERNEL_TYPES.values():
            reason = f"{quantized[0]} has no kernel"
        else:
            reason = f"{quantized[0]} kept float by its layer (experts, or a vocabulary-parallel table)"
        out[reason] = out.get(reason, 0) + param.numel() * param.element_size()
    return out


# ---- tokenizer ----------------------------------------------------------------------------
def tokenizer_cache_dir(path: str) -> Path:
    """Keyed by a hash of the metadata block (vocab, merges, template live there)."""
    reader = read_gguf(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(int(reader.data_offset)))
    root = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))
    return root / "tokenizers" / h.hexdigest()[:32]


def load_gguf_tokenizer(path: str):
    from transformers import AutoTokenizer

    cache = tokenizer_cache_dir(path)
    if (cache / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cache))
        except Exception as e:  # noqa: BLE001 - a broken cache is rebuilt
            log.warning("rebuilding tokenizer cache %s: %s", cache, e)
    folder, name = os.path.split(os.path.abspath(path))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    template = read_gguf(path).fields.get("tokenizer.chat_template")
    if template and not getattr(tok, "chat_template", None):  # tokenizer classes vary
        tok.chat_template = template
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(cache))
    except OSError as e:
        log.warning("could not cache the tokenizer in %s: %s", cache, e)
    return tok
