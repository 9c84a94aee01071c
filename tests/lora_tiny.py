"""Tiny PEFT LoRA adapters for the tests, and transformers + PEFT as their oracle (no hub)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def no_failed_steps(request, caplog):
    """A step that fails is rerun request by request, which would hide a bug in the batched path behind correct
    output: every test of a module that imports this (but one that makes a step fail on purpose) runs without."""
    caplog.set_level(logging.WARNING, logger="tokenmill.engine.core")
    yield
    if "fails_only_its_request" not in request.node.name:
        failed = [r.getMessage() for r in caplog.get_records("call") if "failed" in r.getMessage()]
        assert not failed, failed


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


def write_gguf_lora(peft_dir: str | os.PathLike, out: str | os.PathLike, n_head: int, n_kv_head: int,
                    arch: str = "llama", qtype=None) -> Path:
    """A PEFT adapter written the way llama.cpp's convert_lora_to_gguf.py lays it out: general.type adapter,
    adapter.lora.alpha, `blk.{i}.{part}.weight.lora_a` / `.lora_b`, and for Llama the rows of q's and k's B
    permuted into llama.cpp's rope order, as the base weights are. With `qtype`, tensors whose rows fill whole
    blocks are quantized and the others stored as F16."""
    import json

    import gguf
    from safetensors.torch import load_file

    from gguf_tiny import LAYER_NAMES, permute

    peft_dir = Path(peft_dir)
    cfg = json.loads((peft_dir / "adapter_config.json").read_text())
    tensors = load_file(str(peft_dir / "adapter_model.safetensors"))
    w = gguf.GGUFWriter(str(out), arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(cfg["lora_alpha"]))
    for key, t in sorted(tensors.items()):
        module = key.removeprefix("base_model.model.model.").rsplit(".lora_", 1)[0]  # layers.0.self_attn.q_proj
        which = "lora_a" if ".lora_A." in key else "lora_b"
        _, i, rest = module.split(".", 2)
        a = t.float().numpy()
        if arch == "llama" and which == "lora_b" and rest in ("self_attn.q_proj", "self_attn.k_proj"):
            a = permute(a, n_head if rest == "self_attn.q_proj" else n_kv_head)
        name = f"blk.{i}.{LAYER_NAMES[rest]}.weight.{which}"
        if qtype is not None and a.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        elif qtype is not None:  # rows too short for quantized blocks: F16, as the converter falls back
            w.add_tensor(name, a.astype("float16"))
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)
