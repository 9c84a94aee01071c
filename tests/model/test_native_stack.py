"""The native decoder stack (csrc/decoder_stack.cpp, model/native_stack.py) runs the same kernels as the Python
layers, so a model's greedy tokens and logprobs must be bit for bit the Python path's, over prompt chunks,
mixed batches and decode, for every linear kind it takes; models it does not take keep the Python layers."""
from __future__ import annotations

import gguf
import pytest
import torch

from gguf_tiny import smollm2_layout, write_gguf
from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams, native
from tokenmill.model import native_stack
from tokenmill.model.native_stack import NativeStack

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not native_stack.enabled(), reason="native kernels without DecoderStack")]

T = gguf.GGMLQuantizationType
# A long prompt (chunked at 32 tokens), two short ones: prompt chunks and decodes share steps.
PROMPTS = [list(range(3, 70)), [5, 17, 33, 101], [200, 201, 7, 9, 11, 300, 2, 45]]


def _run(monkeypatch, path, stack: bool, **kw):
    monkeypatch.setenv(native_stack.ENV, "1" if stack else "0")
    llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=64, max_num_batched_tokens=32, **kw)
    sp = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=3)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    stack = llm.engine.model._stack
    used = isinstance(stack, NativeStack) and all(c is not None for c in stack.caches)  # built and bound: it ran
    llm.close()
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs], used


def _same(monkeypatch, path, **kw):
    python, used = _run(monkeypatch, path, False, **kw)
    assert not used
    fast, used = _run(monkeypatch, path, True, **kw)
    assert used, "the model should have run on the native stack"
    for (tp, lp), (tf, lf) in zip(python, fast):
        assert tf == tp
        for a, b in zip(lf, lp):  # same kernels, same order: equal logprobs, not merely close
            assert [(t, x.logprob) for t, x in a] == [(t, x.logprob) for t, x in b]


@pytest.mark.parametrize("arch,kw", [
    ("llama", {}),
    ("qwen2", {}),  # qkv bias
    ("qwen3", {}),  # q/k norms, tied head
    ("llama", {"quantization": "int8"}),
    ("llama", {"quantization": "int4"}),
    ("llama", {"kv_cache_dtype": "bfloat16"}),
    ("qwen2", {"quantization": "int8", "activation_quantization": "int8_per_token"}),  # W8A8, with qkv bias
], ids=["llama", "qwen2-bias", "qwen3-qknorm", "int8", "int4", "bf16-cache", "int8-w8a8"])
def test_same_output_as_python_layers(tmp_path, monkeypatch, arch, kw):
    _same(monkeypatch, make_tiny_model(tmp_path / arch, arch), **kw)


@pytest.mark.parametrize("kw", [{}, {"activation_quantization": "int8"}, {"quantized_batch_dtype": "bfloat16"}],
                         ids=["float", "x8", "bf16-batches"])
def test_gguf_blocks_mixed_with_a_dequantized_layer(tmp_path, monkeypatch, kw):
    """GGUF blocks (Q4_0 / Q4_1 / Q8_0) next to a Q5_0 layer dequantized at load to dense float32 (bf16 batches:
    the 32-token prompt chunks take the bf16 GEMM, in both paths alike)."""
    folder = make_tiny_model(tmp_path / "m", "llama", tie_word_embeddings=True)

    path = write_gguf(folder, tmp_path / "m.gguf", types=smollm2_layout)
    _same(monkeypatch, path, tokenizer=str(folder), **kw)


def test_quantized_cache_steps_run_the_python_layers(tmp_path, monkeypatch):
    """An int8 KV cache is not the stack's: every step takes the Python layers, output unchanged."""
    path = make_tiny_model(tmp_path / "m", "llama")
    monkeypatch.setenv(native_stack.ENV, "1")
    llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=64, kv_cache_dtype="int8")
    stack = llm.engine.model._native_stack()
    assert isinstance(stack, NativeStack)  # the model qualifies; the cache does not
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert all(c is None for c in stack.caches)  # never bound: the Python layers ran
    llm.close()


def test_models_it_does_not_take(tmp_path, monkeypatch):
    gemma = LLM(str(make_tiny_model(tmp_path / "g", "gemma3")), max_model_len=64, num_gpu_blocks_override=16)
    assert NativeStack.why_not(gemma.engine.model) == "sandwich norms"
    gemma.close()
    moe = LLM(str(make_tiny_model(tmp_path / "x", "mixtral")), max_model_len=64, num_gpu_blocks_override=16)
    assert "dense MLP" in NativeStack.why_not(moe.engine.model)
    moe.close()
    monkeypatch.setenv(native_stack.ENV, "0")
    llama = LLM(str(make_tiny_model(tmp_path / "l", "llama")), max_model_len=64, num_gpu_blocks_override=16)
    assert native_stack.ENV in NativeStack.why_not(llama.engine.model)
    assert llama.engine.model._native_stack() is None
    llama.close()


def test_bad_arguments_are_refused():
    s = torch.classes.tokenmill.DecoderStack()
    w = torch.zeros(4, 4)
    with pytest.raises(RuntimeError, match="unknown linear kind"):
        s.add_linear("fp4", w, None, None, None, 0, 0, 0, False, False)
    with pytest.raises(RuntimeError, match="float32"):
        s.add_linear("dense", w.to(torch.bfloat16), None, None, None, 0, 0, 0, False, False)
    with pytest.raises(RuntimeError, match="no linear"):
        s.add_layer(w[0], w[0], 1e-5, 0.0, None, None, 0, 0, 0, 0, 1, 1, 4, 1.0, 0, 0.0, w, w, 0)
    assert native.available()
