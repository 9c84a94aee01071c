"""benchmarks/model_shapes.py: random-weight models of real shapes (issue 45), checked on the tiny-test shape:
each GGUF type loads and generates in tokenmill, holds the tensors its shape says with sane values and the
embedded file's tokenizer; the HF folder gives the same greedy tokens in tokenmill and transformers; files are
made once."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import model_shapes as ms  # noqa: E402

SHAPE = ms.SHAPES["tiny-test"]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("model_shapes")


def _small_llm(path, **kw):
    from tokenmill import LLM

    # A small KV cache: the default reserves gigabytes this test never uses.
    return LLM(str(path), max_model_len=256, kv_cache_memory_bytes=16 << 20, **kw)


def _greedy(llm, ids: list[int], n: int = 4) -> list[int]:
    from tokenmill import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=n, temperature=0.0), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


@pytest.mark.parametrize("qtype", ms.QTYPES)
def test_gguf_loads_and_generates_in_tokenmill(work, qtype):
    path = ms.ensure_gguf("tiny-test", qtype, work)
    tokens = _greedy(_small_llm(path), [504, 3575, 282, 4649, 314])
    assert len(tokens) == 4 and all(0 <= t < SHAPE.vocab for t in tokens)


@pytest.mark.parametrize("qtype", ms.QTYPES)
def test_gguf_tensors_are_the_shapes(work, qtype):
    """Every tensor the shape names, with its [cols, rows] and type (K-quants fall back where a row is not
    whole super-blocks: ffn_down, 384 wide), no output.weight (tied), and values of std ~0.02, finite."""
    import gguf

    reader = gguf.GGUFReader(str(ms.ensure_gguf("tiny-test", qtype, work)))
    got = {t.name: t for t in reader.tensors}
    want = dict(ms.gguf_tensors(SHAPE))
    assert set(got) == set(want)
    for name, dims in want.items():
        t = got[name]
        assert [int(x) for x in t.shape] == list(reversed(dims)), name
        if len(dims) == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32 and np.all(t.data == 1.0), name
            continue
        fallback = "ffn_down" in name and qtype in ms.K_FALLBACK
        assert t.tensor_type.name == (ms.K_FALLBACK[qtype] if fallback else qtype), name
    for name in ("token_embd.weight", "blk.1.attn_k.weight", "blk.0.ffn_down.weight"):
        w = gguf.quants.dequantize(got[name].data, got[name].tensor_type)
        assert np.isfinite(w).all() and 0.015 < w.std() < 0.03 and abs(w.mean()) < 0.005, (name, w.std())
    f = reader.fields
    assert f["general.architecture"].contents() == "llama"
    assert f["general.file_type"].contents() == gguf.LlamaFileType[ms.FILE_TYPE[qtype]]
    assert f["llama.embedding_length"].contents() == SHAPE.hidden
    assert f["llama.feed_forward_length"].contents() == SHAPE.intermediate
    assert f["llama.block_count"].contents() == SHAPE.layers
    assert f["llama.attention.head_count"].contents() == SHAPE.heads
    assert f["llama.attention.head_count_kv"].contents() == SHAPE.kv_heads
    assert f["llama.rope.freq_base"].contents() == SHAPE.rope_theta


def test_gguf_tokenizer_metadata_is_the_embedded_files(work):
    import gguf

    mine = gguf.GGUFReader(str(ms.ensure_gguf("tiny-test", "Q4_0", work))).fields
    ref = gguf.GGUFReader(ms.embedded_gguf()).fields
    keys = [k for k in ref if k.startswith("tokenizer.")]
    assert "tokenizer.ggml.tokens" in keys and "tokenizer.chat_template" in keys
    assert len(ref["tokenizer.ggml.tokens"].contents()) == SHAPE.vocab
    for k in keys:
        assert mine[k].types == ref[k].types, k
        assert mine[k].contents() == ref[k].contents(), k


def test_hf_folder_same_greedy_tokens_in_tokenmill_and_transformers(work):
    import torch
    import transformers as tf

    folder = ms.ensure_hf("tiny-test", "bfloat16", work)
    ids = tf.AutoTokenizer.from_pretrained(folder)(PROMPT)["input_ids"]
    assert ids == [504, 3575, 282, 4649, 314]  # the real SmolLM2 vocabulary
    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert model.config.hidden_size == SHAPE.hidden and model.config.tie_word_embeddings
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    assert _greedy(_small_llm(folder, dtype="float32"), ids, n=6) == ref


def test_second_call_returns_the_cached_files(work):
    paths = [ms.ensure_gguf("tiny-test", "Q8_0", work), ms.ensure_hf("tiny-test", "bfloat16", work)]
    stamps = [p.stat().st_mtime_ns for p in paths] + [(paths[1] / "model.safetensors").stat().st_mtime_ns]
    again = [ms.ensure_gguf("tiny-test", "Q8_0", work), ms.ensure_hf("tiny-test", "bfloat16", work)]
    assert again == paths
    assert [p.stat().st_mtime_ns for p in again] + [(again[1] / "model.safetensors").stat().st_mtime_ns] == stamps
    assert not [p for p in Path(work).iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_unknown_names_are_refused(work):
    with pytest.raises(ValueError):
        ms.ensure_gguf("tiny-test", "Q3_K", work)
    with pytest.raises(ValueError):
        ms.ensure_hf("no-such-shape", "bfloat16", work)
