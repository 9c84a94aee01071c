"""Tiny PEFT LoRA adapters for the tests, and transformers + PEFT as their oracle (no hub)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: str | os.PathLike, path: str | os.PathLike, r: int = 8, alpha: float = 16,
                 rslora: bool = False, targets: list[str] = ALL, seed: int = 0, scale: float = 0.1) -> Path:
    """A random PEFT LoRA adapter (A and B both non-zero) for the model at `base`, saved to `path`."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, init_lora_weights=False)
    peft_model = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    path = Path(path)
    peft_model.save_pretrained(path)
    return path


def peft_greedy(base: str | os.PathLike, adapter: str | os.PathLike | None, prompts: list[list[int]],
                new_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    """transformers (+ PEFT reading `adapter` from disk; None: the base model) greedy: tokens and logprobs."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    results = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
            tokens = out.sequences[0, len(p):].tolist()
            logprobs = torch.stack([torch.log_softmax(step[0].float(), -1) for step in out.logits])
            results.append((tokens, logprobs))
    return results
