"""Tiny random-weight models and a tiny tokenizer, built on the fly (no hub)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "def main():\n    print('hello world')\n    return 0\n",
    "Continuous batching schedules new tokens for every running request each step.",
    "Numbers like 12345 and 3.14159 appear in text, as do emojis 😀 and accents: café, naïve.",
    "SELECT * FROM users WHERE id = 42;",
    "Once upon a time there was a small language model that could count to ten.",
    "Le renard brun rapide saute par-dessus le chien paresseux.",
]


def build_tokenizer(vocab_size: int = 384, added_tokens: tuple[str, ...] = ()):
    """Byte-level BPE tokenizer trained on a small corpus, with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        unk_token=None,
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML
    if added_tokens:  # e.g. <think> and </think>: one token each, but text (not special), as in reasoning models
        fast.add_tokens(list(added_tokens))
    return fast


_ARCH_DEFAULTS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def make_config(arch: str, vocab_size: int, **overrides):
    import transformers as tf

    kw = dict(_ARCH_DEFAULTS, vocab_size=vocab_size)
    if arch == "llama":
        kw.update(rms_norm_eps=1e-5, tie_word_embeddings=False)
        cls = tf.LlamaConfig
    elif arch == "mistral":
        kw.update(sliding_window=24, tie_word_embeddings=False)
        cls = tf.MistralConfig
    elif arch == "qwen2":
        kw.update(tie_word_embeddings=False)
        cls = tf.Qwen2Config
    elif arch == "qwen3":
        kw.update(head_dim=32, tie_word_embeddings=True)
        cls = tf.Qwen3Config
    elif arch == "mixtral":
        kw.update(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, tie_word_embeddings=False)
        cls = tf.MixtralConfig
    elif arch == "qwen2_moe":
        kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                  norm_topk_prob=False, tie_word_embeddings=False)
        cls = tf.Qwen2MoeConfig
    elif arch == "qwen3_moe":
        kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32, norm_topk_prob=True,
                  tie_word_embeddings=True)
        cls = tf.Qwen3MoeConfig
    elif arch == "gemma3":
        kw.update(head_dim=16, sliding_window=24, query_pre_attn_scalar=16)
        cls = tf.Gemma3TextConfig
    else:
        raise ValueError(arch)
    kw.update(overrides)
    return cls(**kw)


def make_tiny_model(path: str | os.PathLike, arch: str = "llama", seed: int = 0, dtype=torch.float32,
                    added_tokens: tuple[str, ...] = (), **overrides) -> Path:
    """Write config.json, model.safetensors, tokenizer and generation_config.json to `path`."""
    import transformers as tf

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(added_tokens=added_tokens)
    config = make_config(arch, vocab_size=len(tok), **overrides)
    config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    config.bos_token_id = None
    config.pad_token_id = tok.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Random init is small; scale up so logits are peaked and greedy is not a coin toss.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    gen = {"eos_token_id": [config.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")]}
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path
