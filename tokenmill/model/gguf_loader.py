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

from tokenmill.model.gguf_file import GGUFFile
from tokenmill.model.hf_config import hf_get

if TYPE_CHECKING:
    from tokenmill.layers.quantization.base import QuantizationConfig
    from tokenmill.model.blocks import DecoderForCausalLM

log = logging.getLogger(__name__)

# GGUF architecture -> (transformers config class name, architectures entry)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "glm4": ("Glm4Config", "Glm4ForCausalLM"),
    "deepseek2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),  # or V3's: model/gguf_deepseek.py decides
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM"),  # model/gguf_gpt_oss.py
}
MIXTRAL = ("MixtralConfig", "MixtralForCausalLM")  # llama.cpp writes Mixtral as "llama" with an expert count
# Architectures whose Q/K rows llama.cpp permuted for its rope layout.
PERMUTED_QK = {"llama", "mistral", "granite"}  # llama.cpp's GraniteModel is its LlamaModel's subclass
# Gemma's (1 + w) norms: llama.cpp stores them with the 1 added.
NORM_PLUS_ONE = {"gemma2", "gemma3"}
# Architectures whose rotary covers part of each head: the head size is key_length or hidden / heads, never
# rope.dimension_count (the rotated features).
PARTIAL_ROPE = {"phi3", "glm4"}


@lru_cache(maxsize=4)
def read_gguf(path: str) -> GGUFFile:
    return GGUFFile(path)


def hf_config_from_gguf(path: str):
    """A transformers config equivalent to the GGUF metadata."""
    import transformers

    reader = read_gguf(path)
    meta = reader.fields
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; tokenmill supports: {', '.join(sorted(ARCHS))}")
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise NotImplementedError("GGUF files with precomputed rope_freqs (Llama 3.1 rope scaling) are not supported yet")
    longrope = "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors
    if longrope and arch != "phi3":
        raise ValueError(f"GGUF architecture {arch!r} with LongRoPE factors (rope_factors_long/short tensors) is "
                         "not supported by tokenmill; only phi3's are")

    def m(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    num_heads = int(m("attention.head_count"))
    hidden = int(m("embedding_length"))
    embd = tensors["token_embd.weight"]
    names = MIXTRAL if arch == "llama" and int(m("expert_count", 0) or 0) > 0 else ARCHS[arch]
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
        architectures=[names[1]],
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    if arch in PARTIAL_ROPE:
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
    if arch == "gemma3":
        kw["sliding_window"] = int(m("attention.sliding_window", 512))
        kw["query_pre_attn_scalar"] = int(head_dim or hidden // num_heads)
        kw["rope_parameters"] = {
            "full_attention": rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
        kw["hidden_activation"] = "gelu_pytorch_tanh"
    else:
        kw["rope_parameters"] = rope
        if m("attention.sliding_window"):
            kw["sliding_window"] = int(m("attention.sliding_window"))
    if arch == "deepseek2":  # MLA + DeepSeekMoE: its own keys and config classes
        from tokenmill.model.gguf_deepseek import deepseek2_config

        names, kw = deepseek2_config(m, tensors, kw)
    elif arch == "gpt-oss":  # sinks, alternating windows, its MoE: its own keys
        from tokenmill.model.gguf_gpt_oss import gpt_oss_config

        names, kw = gpt_oss_config(m, tensors, kw)
    else:
        kw.update(_family_kwargs(arch, m, tensors, kw, reader))
        kw.update(_moe_kwargs(arch, m, tensors))
    if arch == "qwen2":
        kw["tie_word_embeddings"] = kw["tie_word_embeddings"]
    # getattr: the transformers config class by name
    cls = getattr(transformers, names[0])
    cfg = cls(**kw)
    cfg.dtype = torch.float32
    cfg.gguf_architecture = arch
    return cfg


def _family_kwargs(arch: str, m, tensors: dict, kw: dict, reader: GGUFFile) -> dict:
    """The config fields of Granite, OLMo 2, Phi-3, Gemma 2 and GLM-4 from llama.cpp's metadata keys (as its
    convert_hf_to_gguf.py writes them); empty for the other architectures."""
    head_dim = int(kw.get("head_dim") or kw["hidden_size"] // kw["num_attention_heads"])
    if arch == "granite":
        # llama.cpp: attention.scale 0 or absent means 1/sqrt(head_dim); the others absent mean 1
        return dict(embedding_multiplier=float(m("embedding_scale", 1.0) or 1.0),
                    residual_multiplier=float(m("residual_scale", 1.0) or 1.0),
                    attention_multiplier=float(m("attention.scale", 0.0) or head_dim**-0.5),
                    logits_scaling=float(m("logit_scale", 1.0) or 1.0))
    if arch == "gemma2":
        # llama.cpp's gemma2 scales queries by 1/sqrt(head_dim), but by 1/sqrt(hidden / heads) for the 27B
        # (46 layers), which is what that checkpoint's query_pre_attn_scalar says; the file has no key for it
        scalar = kw["hidden_size"] // kw["num_attention_heads"] if kw["num_hidden_layers"] == 46 else head_dim
        out = dict(head_dim=head_dim, query_pre_attn_scalar=int(scalar),
                   hidden_activation="gelu_pytorch_tanh", sliding_window=int(m("attention.sliding_window", 4096)))
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if m(key) is not None:
                out[key] = float(m(key))
        return out
    if arch in PARTIAL_ROPE:
        rope_dim = int(m("rope.dimension_count") or (head_dim // 2 if arch == "glm4" else head_dim))
        rope = dict(kw["rope_parameters"], partial_rotary_factor=rope_dim / head_dim)
        if arch == "phi3" and ("rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors):
            rope.update(_phi3_longrope(arch, m, tensors, reader))
        out = dict(rope_parameters=rope, partial_rotary_factor=rope_dim / head_dim)
        if "original_max_position_embeddings" in rope:
            out["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
        if arch == "glm4":
            out["attention_bias"] = "blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors
        return out
    return {}


def _phi3_longrope(arch: str, m, tensors: dict, reader: GGUFFile) -> dict:
    """Phi-3 128k / Phi-3.5 / Phi-4-mini: llama.cpp's converter writes LongRoPE as two F32 tensors of rope_dim / 2
    factors, the original context length and the attention factor it computed as transformers does."""
    import gguf

    missing = [n for n in ("rope_factors_long.weight", "rope_factors_short.weight") if n not in tensors]
    original = m("rope.scaling.original_context_length")
    if missing or not original:
        raise ValueError(f"GGUF architecture {arch!r}: LongRoPE needs rope_factors_long, rope_factors_short and "
                         f"{arch}.rope.scaling.original_context_length; missing "
                         f"{', '.join(missing) or f'{arch}.rope.scaling.original_context_length'}")
    factors = {}
    for name in ("long", "short"):
        t = tensors[f"rope_factors_{name}.weight"]
        raw = reader.raw(t)
        factors[f"{name}_factor"] = [float(x) for x in gguf.quants.dequantize(
            raw, gguf.GGMLQuantizationType(t.ggml_type)).reshape(-1)]
    out = dict(rope_type="longrope", original_max_position_embeddings=int(original), **factors)
    if m("rope.scaling.attn_factor") is not None:
        out["attention_factor"] = float(m("rope.scaling.attn_factor"))
    return out


def _moe_kwargs(arch: str, m, tensors: dict) -> dict:
    """Mixtral / Qwen2-MoE / Qwen3-MoE hyper-parameters from `{arch}.expert_*` (empty for dense files).
    Every layer is sparse (llama.cpp has no dense-layer list); top-k renormalisation is llama.cpp's
    per-architecture default unless the file says (`expert_weights_norm`)."""
    experts = int(m("expert_count", 0) or 0)
    if experts == 0:
        return {}
    top_k = int(m("expert_used_count"))
    if arch == "llama":
        return dict(num_local_experts=experts, num_experts_per_tok=top_k)
    kw = dict(num_experts=experts, num_experts_per_tok=top_k, decoder_sparse_step=1, mlp_only_layers=[],
              moe_intermediate_size=int(m("expert_feed_forward_length")),
              norm_topk_prob=bool(m("expert_weights_norm", arch == "qwen3moe")))
    if arch == "qwen2moe":
        kw["shared_expert_intermediate_size"] = int(m("expert_shared_feed_forward_length", 0) or 0)
        kw["qkv_bias"] = "blk.0.attn_q.bias" in tensors
    return kw


_LAYER_PARTS = [
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "self_attn.q_norm", "self_attn.k_norm", "input_layernorm", "post_attention_layernorm",
    "pre_feedforward_layernorm", "post_feedforward_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    "mlp.gate", "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj",  # merged [E, ...]
    "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
    "mlp.shared_expert_gate",
]
# Tensors that llama.cpp's generic map names ambiguously for an architecture (Phi-3's and GLM-4's fused gate_up
# is its ffn_up; GLM-4-0414's post_attention_layernorm is the pre-MLP norm, ffn_norm): GGUF block part ->
# transformers part, applied over gguf-py's map.
_FAMILY_PARTS = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "glm4": {"ffn_up": "mlp.gate_up_proj",
             "post_attention_norm": "post_self_attn_layernorm", "ffn_norm": "post_attention_layernorm",
             "post_ffw_norm": "post_mlp_layernorm"},
}
# Older llama.cpp Mixtral files: one tensor per expert, blk.N.ffn_gate.E.weight (gguf-py no longer maps them).
_LEGACY_EXPERT = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}


def _hf_names(cfg) -> list[str]:
    """transformers module names a checkpoint of the GGUF architectures may hold (generic parts; _FAMILY_PARTS
    settles the ones llama.cpp names ambiguously)."""
    names = ["model.embed_tokens", "model.norm", "lm_head"]
    for i in range(cfg.num_hidden_layers):
        names.extend(f"model.layers.{i}.{part}" for part in _LAYER_PARTS)
    return names


def gguf_to_hf_names(path: str, cfg) -> dict[str, str]:
    import gguf

    arch = cfg.gguf_architecture
    if arch == "deepseek2":
        from tokenmill.model.gguf_deepseek import deepseek2_tensor_names

        return deepseek2_tensor_names(cfg.num_hidden_layers)
    if arch == "gpt-oss":
        from tokenmill.model.gguf_gpt_oss import gpt_oss_tensor_names

        return gpt_oss_tensor_names(cfg.num_hidden_layers)
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_enum, cfg.num_hidden_layers)
    out = {}
    for hf in _hf_names(cfg):
        g = name_map.get_name(hf)
        if g is not None:
            out[f"{g}.weight"] = f"{hf}.weight"
            out[f"{g}.bias"] = f"{hf}.bias"
    for i in range(cfg.num_hidden_layers):
        for g, hf in _FAMILY_PARTS.get(arch, {}).items():
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
    arch = cfg.gguf_architecture
    joiner = None
    if arch == "deepseek2":
        from tokenmill.model.gguf_deepseek import KvBJoiner, split_kv_b_part

        joiner = KvBJoiner()
    experts = None
    if arch == "gpt-oss":
        from tokenmill.model.gguf_gpt_oss import ExpertJoiner

        experts = ExpertJoiner(keep_mxfp4=keep_blocks is not None and hf_get(cfg, "gguf_expert_type") == "MXFP4")
    for t in reader.tensors:
        hf = names.get(t.name)
        if hf is None:
            log.debug("skipping GGUF tensor %s", t.name)
            continue
        raw = reader.raw(t)  # validated: known type, whole blocks, bytes inside the file
        if experts is not None and experts.keeps(hf, t.ggml_type):  # gpt-oss's MXFP4 experts, kept MXFP4
            for name, a in experts.add_mxfp4(hf, raw, tuple(int(d) for d in reversed(t.shape))):
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
        part = split_kv_b_part(t.name) if joiner is not None and not blocks else None
        if part is not None:  # newer DeepSeek files: kv_b_proj split per head into k_b (transposed) and v_b
            w = joiner.add(t.name, part, w)
            if w is None:
                continue
        if arch in PERMUTED_QK:
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
        if arch in NORM_PLUS_ONE and t.name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's (1 + w) norm weights with the 1 added
        for hf, w in experts.add(hf, w) if experts is not None else ((hf, w),):
            yield hf, torch.from_numpy(np.ascontiguousarray(w)).to(dtype)
    if joiner is not None:
        joiner.check_done(path)
    if experts is not None:
        experts.check_done(path)


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
