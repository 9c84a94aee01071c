"""Load a model from a Hugging Face folder: config.json (4.x or 5.x style) and safetensors via mmap."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Iterator

import torch

from tokenmill.layers.quantization.base import QuantizationConfig
from tokenmill.model.hf_config import hf_get
from tokenmill.model.mapped_pages import MappedPages, trim_heap
from tokenmill.model.registry import resolve
from tokenmill.model.weights import load_weights
from tokenmill.platform import choose_dtypes

log = logging.getLogger(__name__)


def load_hf_config(path: str):
    from transformers import AutoConfig

    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model folder {path!r} has no config.json")
    raw = json.loads((p / "config.json").read_text())
    try:
        cfg = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError) as e:
        raise ValueError(
            f"unsupported model architecture {raw.get('architectures')!r} "
            f"(model_type {raw.get('model_type')!r}) in config.json: {e}"
        ) from None
    resolve(hf_get(cfg, "architectures"))  # fail early on unknown architectures
    return cfg


def safetensors_files(path: str) -> list[Path]:
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [p / n for n in names]
    else:
        files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path!r}")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"weight shard {f.name} listed in the index is missing from {path!r}")
    return files


def iter_safetensors(path: str, dtype: torch.dtype | None,
                     pages: MappedPages | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors by name, floats converted to `dtype` (None: as stored, for quantized checkpoints whose
    scales must not lose precision and whose fp8 weights stay fp8; the loaders convert into place).
    Tensors are views of the file's mapping; `pages` notes them, so the loader can give back the pages of
    those no parameter keeps (a converted tensor's source is dead at once)."""
    from safetensors import safe_open

    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as st:  # memory-mapped
            for name in st.keys():
                t = st.get_tensor(name)
                if pages is not None:
                    pages.track(str(f), t)
                yield name, t.to(dtype) if dtype is not None and t.is_floating_point() else t


def config_dtype(cfg) -> torch.dtype:
    d = hf_get(cfg, "dtype") or hf_get(cfg, "torch_dtype") or torch.float32  # torch_dtype: older transformers
    if isinstance(d, str):
        d = getattr(torch, d)  # getattr: a torch dtype by name ("bfloat16")
    return d


def is_gguf(path: str) -> bool:
    return str(path).endswith(".gguf") and os.path.isfile(path)


def load_model(path: str, dtype: str = "auto", max_model_len: int | None = None, device: str = "cpu", *,
               quant_config: QuantizationConfig | None = None, tp_rank: int = 0, tp_size: int = 1,
               expert_parallel: bool = False, pp_rank: int = 0, pp_size: int = 1):
    """Returns (model, hf_config, max_model_len). `path` is a Hugging Face folder or a .gguf file; the
    model holds tensor-parallel rank `tp_rank`'s shard of every layer."""
    if is_gguf(path):
        from tokenmill.model.gguf_loader import hf_config_from_gguf

        cfg = hf_config_from_gguf(path)
    else:
        cfg = load_hf_config(path)
    from tokenmill.layers.quantization.checkpoint import resolve_quantization

    quant_config = resolve_quantization(cfg, quant_config, path)
    prequantized = hf_get(cfg, "quantization_config") is not None
    storage, compute = choose_dtypes(dtype, config_dtype(cfg), device)
    max_pos = int(hf_get(cfg, "max_position_embeddings", 0) or 0) or 2048
    if max_model_len is None:
        max_model_len = max_pos
    elif max_model_len < 1:
        raise ValueError(f"max_model_len must be at least 1, got {max_model_len}.")
    elif max_model_len > max_pos:
        raise ValueError(
            f"max_model_len ({max_model_len}) is larger than the model's max_position_embeddings ({max_pos})."
        )
    cls = resolve(cfg.architectures)
    blocks = quant_config is not None and quant_config.name == "gguf"  # GGUF blocks kept (layers/quantization/gguf.py)
    if blocks:
        if not is_gguf(path):
            raise ValueError(f"--quantization gguf keeps the blocks of a .gguf file; {path!r} is not one")
        quant_config.bind(path, cfg, cls)
    with torch.device(device):
        model = cls(cfg, dtype=storage, compute_dtype=compute, max_positions=max_model_len,
                    quant_config=quant_config, tp_rank=tp_rank, tp_size=tp_size, expert_parallel=expert_parallel,
                    pp_rank=pp_rank, pp_size=pp_size)
    pages = None
    if is_gguf(path):
        from tokenmill.model.gguf_loader import iter_gguf_weights

        if blocks:
            quant_config.prepare_model(model)
        load_weights(model, iter_gguf_weights(path, cfg, storage, quant_config.keeps_blocks if blocks else None))
        if blocks:
            quant_config.finish_model(model)
    else:
        pages = MappedPages()
        load_weights(model, iter_safetensors(path, None if prequantized else storage, pages), pages)
    tied = model.tie_word_embeddings
    if quant_config is not None and quant_config.quantize_lm_head and model.lm_head is not None:
        lm_head = model.lm_head
        lm_head.quantize_int8(model.embed_tokens if tied else None, int8_activations=quant_config.int8_activations,
                              per_token=quant_config.per_token_activations)
    elif model.lm_head is not None:
        model.lm_head.pack_for_onednn(tied=tied)
    if pages is not None:
        # The float weights packed at load: their file pages (model/mapped_pages.py) and freed heap go back.
        pages.release(model)
        if pages.released_bytes:
            log.debug("gave back %.1f MiB of weight-file pages after loading", pages.released_bytes / 2**20)
    if quant_config is not None or is_gguf(path):
        trim_heap()  # the transient float copies of packing or GGUF dequantization: freed heap back to the system
    model.eval()
    return model, cfg, max_model_len


def load_tokenizer(model: str, tokenizer: str | None = None):
    from transformers import AutoTokenizer

    src = tokenizer or model
    if is_gguf(src):
        from tokenmill.model.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(src)
    return AutoTokenizer.from_pretrained(src)


def generation_eos_ids(path: str) -> set[int]:
    if not os.path.isdir(path):
        return set()
    f = Path(path) / "generation_config.json"
    if not f.is_file():
        return set()
    eos = json.loads(f.read_text()).get("eos_token_id")
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}


def eos_token_ids(path: str, tokenizer) -> set[int]:
    """Tokens that end generation: generation_config.json's and the tokenizer's EOS."""
    eos = generation_eos_ids(path)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return eos


def is_hf_folder(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))
