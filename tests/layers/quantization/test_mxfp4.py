"""MXFP4 expert weights (quant_method "mxfp4", gpt-oss checkpoints): the decode equals transformers' own
(integrations.mxfp4.convert_moe_packed_tensors); a tiny gpt-oss checkpoint whose experts this file quantizes to
MXFP4 loads with its experts kept as uint8 blocks and scales (no float expert weight in the model) and gives the
greedy tokens and logprobs of transformers running the float model on the dequantized weights (exactly the same
values), also under TP=2 with and without expert parallelism."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_gpt_oss import make_gpt_oss
from test_parity import NEW_TOKENS, check_against_oracle, hf_greedy, prompts_for
from tokenmill import LLM, SamplingParams, native
from tokenmill.layers.quantization.mxfp4 import FP4_VALUES, NATIVE_ENV, dequantize_mxfp4


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]): per block of 32 the smallest power
    of two that brings its largest magnitude within e2m1's 6, each value rounded to the nearest e2m1 value."""
    g = w.float().unflatten(-1, (-1, 32))  # [..., G, 32]
    amax = g.abs().amax(-1).clamp(min=2.0**-100)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = g / torch.exp2(exp).unsqueeze(-1)
    table = torch.tensor(FP4_VALUES)
    codes = (scaled.unsqueeze(-1) - table).abs().argmin(-1).to(torch.uint8)  # ties: the lower code (+0 over -0)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def test_decode_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 8, 4), dtype=torch.uint8)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, cols, rows] (transposed)
    torch.testing.assert_close(dequantize_mxfp4(blocks, scales), ref.transpose(1, 2), atol=0, rtol=0)
    # and the quantizer above is a right inverse of the decode on values it can hold
    b2, s2 = quantize_mxfp4(dequantize_mxfp4(blocks, scales))
    torch.testing.assert_close(dequantize_mxfp4(b2, s2), dequantize_mxfp4(blocks, scales), atol=0, rtol=0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """(float checkpoint whose expert weights are the MXFP4 values, the same checkpoint in MXFP4 form)."""
    root = tmp_path_factory.mktemp("mxfp4")
    float_path = make_gpt_oss(root / "float", intermediate_size=64)
    mx_path = root / "mxfp4"
    mx_path.mkdir()
    (shard,) = float_path.glob("*.safetensors")
    tensors = load_file(str(shard))
    quantized = {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(t.transpose(1, 2))  # [E, in, out] -> rows are output features
            quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
            tensors[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
        else:
            quantized[name] = t
    save_file(tensors, str(shard), metadata={"format": "pt"})
    save_file(quantized, str(mx_path / "model.safetensors"), metadata={"format": "pt"})
    for f in float_path.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            (mx_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((mx_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    (mx_path / "config.json").write_text(json.dumps(config))
    return float_path, mx_path


@pytest.mark.parametrize("path", ["native", "torch"])
def test_mxfp4_experts_match_transformers_on_dequantized_weights(checkpoints, path, monkeypatch):
    """Both expert matmuls: the native kernel (csrc/mxfp4_linear.cpp) and the torch decode-and-multiply fallback."""
    if path == "native" and not native.has_op("mxfp4_linear"):
        pytest.skip("tokenmill._C without mxfp4_linear")
    monkeypatch.setenv(NATIVE_ENV, "1" if path == "native" else "0")
    float_path, mx_path = checkpoints
    llm = LLM(str(mx_path), max_model_len=128, num_gpu_blocks_override=64, attention_backend="torch_sdpa")
    experts = llm.engine.model.layers[0].mlp.experts
    names = {n for n, _ in experts.named_parameters()}
    assert names == {"gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales",
                     "gate_up_proj_bias", "down_proj_bias"}
    assert experts.gate_up_proj_blocks.dtype == torch.uint8 and experts.down_proj_scales.dtype == torch.uint8
    prompts = prompts_for(llm.engine.vocab_size)
    oracle = hf_greedy(float_path, prompts)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=3)
    check_against_oracle(llm.generate(prompts, sp, use_tqdm=False), oracle, "mxfp4")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mxfp4_tp2_equals_float_tp1(checkpoints):
    from compare import assert_same_outputs

    float_path, mx_path = checkpoints
    prompts = prompts_for(384, seed=4)[:4]
    sp = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, logprobs=3)
    outs = []
    for path, kw in ((float_path, {}), (mx_path, dict(tensor_parallel_size=2)),
                     (mx_path, dict(tensor_parallel_size=2, enable_expert_parallel=True))):
        llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=64, attention_backend="torch_sdpa", **kw)
        try:
            outs.append([o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)])
        finally:
            llm.engine.shutdown()
    assert_same_outputs(outs[0], outs[1], "mxfp4 tp=2", atol=1e-4)
    assert_same_outputs(outs[0], outs[2], "mxfp4 tp=2 ep", atol=1e-4)
