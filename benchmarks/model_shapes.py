"""Random-weight models of real configurations, for measuring speed at real sizes (issue 45).

Speed depends on shapes and types, not on values, so the weights are random bytes written straight into the
file: a llama-architecture GGUF whose matrices are random blocks of one quantization type ("pure", token_embd
too, tied LM head), or a Hugging Face folder of normal(0, 0.02) tensors. Both carry the real SmolLM2 tokenizer
(copied from the embedded GGUF), so tokenmill, llama.cpp and vLLM load them with the 49152-token vocabulary.

Files are made once under --work (default ~/.cache/tokenmill/model_shapes) and reused: each is written under a
temporary name and renamed when complete, so an interrupted run never leaves a file that looks finished.

    python benchmarks/model_shapes.py smollm2-1.7b --gguf Q4_0 --gguf Q8_0 --hf bfloat16   # prints the paths

Block scales are chosen so that every quantized matrix has values of standard deviation about 0.02 (as a
trained model's) and activations stay finite through every layer. As llama-quantize does, a matrix whose row
length is not a multiple of 256 falls back from a K-quant to Q5_0 (Q4_K), Q5_1 (Q5_K) or Q8_0 (Q6_K): so
smollm2-135m (hidden 576) is mostly not K-quant even in a "Q4_K" file, while smollm2-1.7b is K-quant throughout.
llama.cpp's Q/K row permutation is not applied: it does not matter for random weights.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from gguf_tiny import k_scales  # noqa: E402  (the K-quant scale packing the tests' GGUF writer uses)

DEFAULT_WORK = Path("~/.cache/tokenmill/model_shapes").expanduser()
TARGET_STD = 0.02  # standard deviation of every random matrix's values (a trained model's order of size)


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    rope_theta: float = 100000.0
    vocab: int = 49152  # SmolLM2's: the tokenizer is the real one
    context: int = 8192
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES: dict[str, Shape] = {
    "smollm2-135m": Shape(hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, rope_theta=100000.0),
    "smollm2-1.7b": Shape(hidden=2048, intermediate=8192, layers=24, heads=32, kv_heads=32, rope_theta=130000.0),
    # For tests. Hidden 256 (not smaller) so that K-quant matrices really hold K-quant blocks (rows of 256);
    # intermediate 384 so that ffn_down (rows of 384) takes llama-quantize's fallback type.
    "tiny-test": Shape(hidden=256, intermediate=384, layers=2, heads=4, kv_heads=2),
}

QTYPES = ("Q4_0", "Q8_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
# llama-quantize's type for a matrix whose rows are not whole 256-value super-blocks.
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# general.file_type (gguf.LlamaFileType) of a file of each type.
FILE_TYPE = {"Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1", "Q8_0": "MOSTLY_Q8_0", "Q4_K": "MOSTLY_Q4_K_M",
             "Q5_K": "MOSTLY_Q5_K_M", "Q6_K": "MOSTLY_Q6_K"}
# Metadata of the embedded GGUF not copied: set here for the new file.
GENERAL_SET_HERE = {"general.architecture", "general.name", "general.finetune", "general.size_label",
                    "general.file_type", "general.quantization_version"}


# ---- quantized blocks from random bytes ---------------------------------------------------------------------
def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """float values [n] -> their float16 bytes [n, 2]."""
    return x.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _scale(rng: np.random.Generator, n: int, d: float) -> np.ndarray:
    """n block scales around d (+-25%), so blocks differ as in a real file."""
    return d * rng.uniform(0.75, 1.25, n)


# Standard deviation of a uniform random b-bit quant, and the K-quant sub-block scales' range [lo, hi):
# small enough six-bit values that the f16 super-block scale d stays a normal float16.
QSTD = {4: 4.61, 5: 9.23, 6: 18.47, 8: 73.9}
K_SC = (8, 16)
K_SC_MEAN = 11.5


def random_blocks(qtype: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """n random blocks of `qtype`, [n, type_size] uint8: random quant bytes, scales set so the values have
    standard deviation ~TARGET_STD around 0 (offset types get min = -scale * (middle quant))."""
    import gguf

    T = gguf.GGMLQuantizationType[qtype]
    size = gguf.GGML_QUANT_SIZES[T][1]
    b = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    if qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        bits = 8 if qtype == "Q8_0" else int(qtype[1])
        d = _scale(rng, n, TARGET_STD / QSTD[bits])
        b[:, 0:2] = _f16_bytes(d)
        if qtype in ("Q4_1", "Q5_1"):  # value = d * q + m, q unsigned: centre it
            b[:, 2:4] = _f16_bytes(-d * (1 << (bits - 1)))
        return b
    if qtype in ("Q4_K", "Q5_K"):  # value = d * sc * q - dmin * mn per 32 values
        bits = int(qtype[1])
        d = _scale(rng, n, TARGET_STD / (QSTD[bits] * K_SC_MEAN))
        sc = rng.integers(*K_SC, size=(n, 8), dtype=np.uint8)
        b[:, 0:2] = _f16_bytes(d)
        b[:, 2:4] = _f16_bytes(d * (1 << (bits - 1)))  # dmin, with mn = sc: centred on 0
        b[:, 4:16] = k_scales(sc, sc)  # (ggml's 12-byte packing, tests/gguf_tiny.py)
        return b
    if qtype == "Q6_K":  # ql[128] qh[64] scales[16] (int8) d: value = d * sc * (q - 32) per 16 values
        d = _scale(rng, n, TARGET_STD / (QSTD[6] * K_SC_MEAN))
        b[:, 192:208] = rng.integers(*K_SC, size=(n, 16), dtype=np.uint8)
        b[:, 208:210] = _f16_bytes(d)
        return b
    raise ValueError(f"no random blocks for {qtype!r}")


def matrix_type(qtype: str, cols: int) -> str:
    """The type a `cols`-wide matrix gets in a pure `qtype` file (llama-quantize's K-quant fallback)."""
    import gguf

    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    return K_FALLBACK[qtype] if cols % block else qtype


# ---- GGUF ---------------------------------------------------------------------------------------------------
def gguf_tensors(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(llama.cpp name, numpy shape [rows, cols]) of every tensor; 1-D ones are norms. Tied: no output.weight."""
    s, q, kv = shape, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (s.vocab, s.hidden))]
    for i in range(s.layers):
        out += [(f"blk.{i}.attn_norm.weight", (s.hidden,)),
                (f"blk.{i}.attn_q.weight", (q, s.hidden)),
                (f"blk.{i}.attn_k.weight", (kv, s.hidden)),
                (f"blk.{i}.attn_v.weight", (kv, s.hidden)),
                (f"blk.{i}.attn_output.weight", (s.hidden, q)),
                (f"blk.{i}.ffn_norm.weight", (s.hidden,)),
                (f"blk.{i}.ffn_gate.weight", (s.intermediate, s.hidden)),
                (f"blk.{i}.ffn_up.weight", (s.intermediate, s.hidden)),
                (f"blk.{i}.ffn_down.weight", (s.hidden, s.intermediate))]
    return out + [("output_norm.weight", (s.hidden,))]


def _rng(*key: str) -> np.random.Generator:
    """A generator seeded by the tensor's identity, so the same file comes out every time."""
    return np.random.default_rng(zlib.crc32("/".join(key).encode()))


def embedded_gguf() -> str:
    from tokenmill.model.default import default_model_path

    return default_model_path()


@lru_cache(maxsize=1)
def source_metadata(source: str) -> tuple[tuple[str, object, int, int | None], ...]:
    """(key, value, type, array item type) of the tokenizer (tokenizer.ggml.*, tokenizer.chat_template) and
    general.* metadata of `source`, as they are there. Cached: reading the file takes seconds."""
    import gguf

    out = []
    for key, field in gguf.GGUFReader(source).fields.items():
        if key.startswith("tokenizer.") or (key.startswith("general.") and key not in GENERAL_SET_HERE):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            out.append((key, field.contents(), vtype, sub))
    return tuple(out)


def copy_metadata(writer, source: str) -> None:
    for key, value, vtype, sub in source_metadata(source):
        writer.add_key_value(key, value, vtype, sub_type=sub)


def write_gguf(shape_name: str, qtype: str, out: Path) -> None:
    """Write the whole file to `out`, one tensor at a time (memory: the largest tensor)."""
    import gguf

    shape = SHAPES[shape_name]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(f"{shape_name} random {qtype}")
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_vocab_size(shape.vocab)
    w.add_file_type(gguf.LlamaFileType[FILE_TYPE[qtype]])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    copy_metadata(w, embedded_gguf())
    # Tensor infos first, then each tensor's data made and written in turn: never the whole model in memory.
    plan = []
    for name, dims in gguf_tensors(shape):
        if len(dims) == 1:
            w.add_tensor_info(name, dims, np.dtype(np.float32), dims[0] * 4)
            plan.append((name, dims, None))
            continue
        t = matrix_type(qtype, dims[1])
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]]
        byte_shape = (dims[0], dims[1] // block * size)
        w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1],
                          raw_dtype=gguf.GGMLQuantizationType[t])
        plan.append((name, dims, t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, dims, t in plan:
        if t is None:
            w.write_tensor_data(np.ones(dims, dtype=np.float32))  # RMS norm weights
        else:
            n = dims[0] * (dims[1] // gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]][0])
            w.write_tensor_data(random_blocks(t, n, _rng(shape_name, qtype, name)))
    w.close()


def _publish(make, final: Path) -> Path:
    """Run make(tmp) on a temporary path next to `final`, then rename it into place (atomic): a file or folder
    at `final` is always complete. Already there: returned as is."""
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        target = tmp / final.name
        make(target)
        try:
            os.rename(target, final)
        except OSError:
            if not final.exists():  # another process finishing first is fine; anything else is not
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def ensure_gguf(shape: str, qtype: str = "Q4_0", work: str | Path = DEFAULT_WORK) -> Path:
    """`work`/`shape`-`qtype`.gguf, written once."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    if qtype not in QTYPES:
        raise ValueError(f"unknown qtype {qtype!r}; known: {', '.join(QTYPES)}")
    return _publish(lambda p: write_gguf(shape, qtype, p), Path(work).expanduser() / f"{shape}-{qtype}.gguf")


# ---- Hugging Face folder ------------------------------------------------------------------------------------
SHARD_BYTES = 1 << 30  # each safetensors shard holds about this much: one shard's tensors in memory at a time


def hf_config(shape: Shape, dtype: str) -> dict:
    """config.json of LlamaForCausalLM; rope_theta both ways (transformers 4 reads the key, 5 rope_parameters)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "vocab_size": shape.vocab, "max_position_embeddings": shape.context, "rms_norm_eps": shape.rms_eps,
        "rope_theta": shape.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
        "initializer_range": 0.02, "use_cache": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
        "torch_dtype": dtype, "dtype": dtype,
    }


def hf_tensors(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(transformers name, shape) of every tensor, from the GGUF list (same tensors, other names)."""
    layer = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    out = []
    for name, dims in gguf_tensors(shape):
        if name == "token_embd.weight":
            out.append(("model.embed_tokens.weight", dims))
        elif name == "output_norm.weight":
            out.append(("model.norm.weight", dims))
        else:
            _, i, base, _ = name.split(".")
            out.append((f"model.layers.{i}.{layer[base]}.weight", dims))
    return out


def write_safetensors(shape_name: str, dtype: str, folder: Path) -> None:
    """Shards of about SHARD_BYTES, each generated and written before the next (norms ones, the rest
    normal(0, 0.02) in `dtype`); an index when there is more than one shard."""
    import torch
    from safetensors.torch import save_file

    tdtype = getattr(torch, dtype)
    elem = torch.empty((), dtype=tdtype).element_size()
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in hf_tensors(SHAPES[shape_name]):
        nbytes = int(np.prod(dims)) * elem
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map = {}
    for file, shard in zip(files, shards):
        tensors = {}
        for name, dims in shard:
            if len(dims) == 1:
                tensors[name] = torch.ones(dims, dtype=tdtype)
            else:
                g = torch.Generator().manual_seed(zlib.crc32(f"{shape_name}/{name}".encode()))
                tensors[name] = torch.empty(dims, dtype=tdtype).normal_(0.0, TARGET_STD, generator=g)
            weight_map[name] = file
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        del tensors
    if len(files) > 1:
        total = sum(int(np.prod(d)) * elem for _, d in hf_tensors(SHAPES[shape_name]))
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def write_hf(shape_name: str, dtype: str, folder: Path) -> None:
    import transformers as tf

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config(SHAPES[shape_name], dtype), indent=2))
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}, indent=2))
    # The tokenizer files from the embedded GGUF's metadata (transformers converts it): the same vocabulary.
    src = Path(embedded_gguf())
    tf.AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name).save_pretrained(str(folder))
    write_safetensors(shape_name, dtype, folder)


def ensure_hf(shape: str, dtype: str = "bfloat16", work: str | Path = DEFAULT_WORK) -> Path:
    """`work`/`shape`-hf-`dtype`/, written once."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype {dtype!r}: float32, bfloat16 or float16")
    return _publish(lambda p: write_hf(shape, dtype, p), Path(work).expanduser() / f"{shape}-hf-{dtype}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=list(SHAPES))
    ap.add_argument("--gguf", action="append", default=[], choices=QTYPES, help="a GGUF of this type (repeatable)")
    ap.add_argument("--hf", action="append", default=[], choices=["float32", "bfloat16", "float16"],
                    help="a Hugging Face folder in this dtype (repeatable)")
    ap.add_argument("--work", default=str(DEFAULT_WORK), help=f"cache folder (default {DEFAULT_WORK})")
    args = ap.parse_args()
    if not args.gguf and not args.hf:
        ap.error("give --gguf QTYPE and/or --hf DTYPE")
    for qtype in args.gguf:
        print(ensure_gguf(args.shape, qtype, args.work), flush=True)
    for dtype in args.hf:
        print(ensure_hf(args.shape, dtype, args.work), flush=True)


if __name__ == "__main__":
    main()
