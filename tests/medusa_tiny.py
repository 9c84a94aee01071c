"""Tiny Medusa heads in the published layout (config.json + medusa_lm_head.safetensors / .pt) for a target folder
written by tests/tiny.py, and a target that always answers one token (for heads that copy its path)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def medusa_tensors(hidden: int, vocab: int, heads: int, layers: int, seed: int = 0, proj=None,
                   prefix: str = "medusa_head.") -> dict[str, torch.Tensor]:
    """Random heads (residual blocks near identity), or with every head's projection `proj` [vocab, hidden]
    and zero residual blocks (x + SiLU(0) = x: the head is `proj` over the target's hidden state)."""
    g = torch.Generator().manual_seed(seed)
    w = {}
    for i in range(heads):
        for j in range(layers):
            w[f"{prefix}{i}.{j}.linear.weight"] = torch.zeros(hidden, hidden) if proj is not None else \
                torch.randn(hidden, hidden, generator=g) * 0.05
            w[f"{prefix}{i}.{j}.linear.bias"] = torch.zeros(hidden) if proj is not None else \
                torch.randn(hidden, generator=g) * 0.05
        w[f"{prefix}{i}.{layers}.weight"] = proj.clone() if proj is not None else \
            torch.randn(vocab, hidden, generator=g) * 0.2
    return w


def write_medusa(folder, target_dir, heads: int = 4, layers: int = 1, seed: int = 0, proj=None,
                 fmt: str = "safetensors", prefix: str = "medusa_head.") -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": heads, "medusa_num_layers": layers,
                                                    "base_model_name_or_path": str(target_dir)}))
    w = medusa_tensors(cfg["hidden_size"], cfg["vocab_size"], heads, layers, seed, proj, prefix)
    if fmt == "pt":
        torch.save(w, folder / "medusa_lm_head.pt")
    else:
        save_file(w, str(folder / "medusa_lm_head.safetensors"))
    return folder


def make_constant_target(target_dir, token: int) -> torch.Tensor:
    """In place: zero every layer's o_proj and down_proj (the hidden state at p is norm(embedding(t_p))), give
    every embedding a large first component, and make the LM head's row `token` read it: greedy decoding
    answers `token` after any token. Returns that LM head row direction's projection (a [vocab, hidden] matrix
    whose argmax over any hidden state of this target is `token`), for heads that copy it."""
    target_dir = Path(target_dir)
    w = load_file(str(target_dir / "model.safetensors"))
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
    w["model.norm.weight"] = torch.ones_like(w["model.norm.weight"])
    w["model.embed_tokens.weight"][:, 0] = 10.0
    head = w["lm_head.weight"]
    head[token] = 0.0
    head[token, 0] = 50.0
    save_file(w, str(target_dir / "model.safetensors"), metadata={"format": "pt"})
    proj = torch.zeros_like(head)
    proj[token, 0] = 50.0
    return proj
