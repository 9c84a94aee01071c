"""`tokenmill quantize MODEL OUT --method int4|int8`: write a quantized safetensors folder.

The model is loaded with `--quantization METHOD` (the same code, so the same packed bytes), then each
decoder linear weight of the checkpoint is written as the rows of its layer's packed tensors
(`<name>.qweight`, `.scale`, `.zero` for int4): quantization is per output row, so a fused qkv / gate_up
layer splits back into its checkpoint parts exactly. Everything else (embeddings, norms, the LM head)
is copied in float. config.json gets `quantization_config: {"quant_method": "tokenmill", ...}`, so
loading OUT picks the packed method and takes the tensors as they are (no re-quantizing); the LM head
is kept as int8 rows at load, as with --quantization.
"""
from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class QuantizeReport:
    out: Path
    quantized: int  # checkpoint weights written packed
    copied: int  # tensors written as they were
    bytes: int  # of model.safetensors' tensors


def quantize_checkpoint(model: str, out: str, method: str = "int4", group_size: int = 32,
                        symmetric: bool = False, tokenizer: str | None = None) -> QuantizeReport:
    from safetensors.torch import save_file

    from tokenmill.layers.linear import LinearBase
    from tokenmill.layers.quantization.packed import PackedConfig
    from tokenmill.layers.quantization.weight_only import WeightOnlyConfig
    from tokenmill.model.loader import is_gguf, is_hf_folder, load_model
    from tokenmill.model.weights import WeightNaming, _join, _split

    if not (is_hf_folder(model) or is_gguf(model)):
        raise FileNotFoundError(f"{model!r} is neither a Hugging Face model folder (with config.json) nor a .gguf file")
    dst = Path(out)
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"output folder {out!r} exists and is not empty")
    packed_config = PackedConfig(method, group_size, symmetric)  # validates the method and group size
    qmodel, cfg, _ = load_model(model, "float32", quant_config=WeightOnlyConfig(method, group_size, symmetric))
    naming: WeightNaming = qmodel.weight_naming  # a registered model: a DecoderForCausalLM
    fused_of = {part: (fused, i) for fused, parts in qmodel.packed_modules_mapping.items()
                for i, part in enumerate(parts)}
    tied = qmodel.tie_word_embeddings
    modules = dict(qmodel.named_modules())
    tensors: dict[str, torch.Tensor] = {}
    quantized = copied = 0
    for ckpt_name, t in _source_tensors(model, cfg):
        name = naming.param_name(ckpt_name, tied)
        if name is None:
            continue
        parent, part, leaf = _split(name)
        layer, rows = modules.get(_join(parent, part)), None
        if not isinstance(layer, LinearBase) and part in fused_of:
            fused, index = fused_of[part]
            layer = modules.get(_join(parent, fused))
            if isinstance(layer, LinearBase):
                sizes = layer.output_partition_sizes
                rows = (sum(sizes[:index]), sizes[index])
        if isinstance(layer, LinearBase) and leaf == "weight" and hasattr(layer, "qweight"):
            stem = ckpt_name[: -len("weight")]
            own = dict(layer.named_parameters(recurse=False))
            for pname in ("qweight", "scale", "zero"):  # those of them the packed layer has
                p = own.get(pname)
                if p is not None:
                    tensors[stem + pname] = (p.data if rows is None else p.data.narrow(0, *rows)).clone()
            quantized += 1
        else:
            tensors[ckpt_name] = t.contiguous()
            copied += 1
    if quantized == 0:
        raise ValueError(f"{model!r}: no linear layer weights found to quantize")
    dst.mkdir(parents=True, exist_ok=True)
    _copy_tokenizer(tokenizer or model, dst)  # first: the step that fails on a GGUF without a tokenizer
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    _write_config(model, cfg, dst, packed_config.to_json())
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return QuantizeReport(dst, quantized, copied, nbytes)


def _source_tensors(model: str, cfg):
    from tokenmill.model.loader import is_gguf, iter_safetensors

    if is_gguf(model):
        from tokenmill.model.gguf_loader import iter_gguf_weights

        return iter_gguf_weights(model, cfg, torch.float32)
    return iter_safetensors(model, None)


def _write_config(model: str, cfg, dst: Path, quantization_config: dict) -> None:
    from tokenmill.model.loader import is_gguf

    raw = cfg.to_dict() if is_gguf(model) else json.loads((Path(model) / "config.json").read_text())
    raw["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(raw, indent=2, default=str) + "\n")


def _copy_tokenizer(model: str, dst: Path) -> None:
    """The tokenizer and generation config: every small file of the folder but weights and config.json;
    for a GGUF, the tokenizer it embeds."""
    if not (Path(model).is_dir() or Path(model).is_file()):
        raise FileNotFoundError(f"tokenizer {model!r} not found")
    from tokenmill.model.loader import is_gguf, load_tokenizer

    if is_gguf(model):
        tok = load_tokenizer(model)
        tok.save_pretrained(str(dst))
        if tok.eos_token_id is not None:
            (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_token_id}) + "\n")
        return
    for f in Path(model).iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith((".safetensors", ".safetensors.index.json",
                                                                              ".bin", ".pt", ".gguf")):
            shutil.copy2(f, dst / f.name)


def add_quantize_parser(subparsers) -> None:
    p = subparsers.add_parser("quantize", help="Write a quantized copy of a model (loads without re-quantizing).",
                              description="Quantize a float Hugging Face folder or GGUF file into OUT/: the "
                              "decoder linear layers' packed int8/int4 tensors, the rest as it was.")
    p.add_argument("model", help="Hugging Face model folder or .gguf file.")
    p.add_argument("out", help="Output folder (created; must be empty if it exists).")
    p.add_argument("--method", choices=("int4", "int8"), default="int4", help="(default: %(default)s)")
    p.add_argument("--group-size", type=int, default=32, choices=(32, 64, 128),
                   help="int4: input columns per scale and zero point (default: %(default)s).")
    p.add_argument("--symmetric", action="store_true", help="int4: symmetric groups (zero point 8).")
    p.add_argument("--tokenizer", help="Folder whose tokenizer (and generation config) files to copy, or a .gguf "
                   "(default: the model's).")
    p.set_defaults(func=cmd_quantize)


def cmd_quantize(args: argparse.Namespace) -> int:
    report = quantize_checkpoint(args.model, args.out, args.method, args.group_size, args.symmetric, args.tokenizer)
    print(f"wrote {report.out}: {report.quantized} linear weights as {args.method}, {report.copied} tensors copied, "
          f"{report.bytes / 2**20:.1f} MiB")
    return 0
