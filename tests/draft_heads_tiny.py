"""Tiny draft-head checkpoints in the published layouts (EAGLE-1, EAGLE-3, DeepSeek MTP) for a target
folder written by tests/tiny.py, and a paged KV harness for running a target and a head on one sequence.

`copy=True` heads predict what a bigram target (make_bigram_target) would: at position p, given token
t_{p+1}, the target's greedy choice after t_{p+1}."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

EAGLE3_AUX_IDS = [0, 1, 2]  # vLLM numbering (the stream entering layer i); fits a 2-layer target


def _target(target_dir) -> tuple[dict, dict[str, torch.Tensor]]:
    target_dir = Path(target_dir)
    cfg = json.loads((target_dir / "config.json").read_text())
    return cfg, load_file(str(target_dir / "model.safetensors"))


def make_bigram_target(target_dir) -> Path:
    """Zero every layer's o_proj and down_proj and set the final norm to ones, in place: the target's
    hidden state at p is norm(embedding(t_p)), so its next token depends on the current token only."""
    target_dir = Path(target_dir)
    cfg, w = _target(target_dir)
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight", "o_proj.bias", "down_proj.bias")):
            w[name] = torch.zeros_like(w[name])
    w["model.norm.weight"] = torch.ones_like(w["model.norm.weight"])
    save_file(w, str(target_dir / "model.safetensors"), metadata={"format": "pt"})
    return target_dir


def _rand(g: torch.Generator, *shape: int, std: float = 0.08) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * std


def _llama_layer(prefix: str, h: int, inter: int, heads: int, kv_heads: int, head_dim: int, in_dim: int,
                 g: torch.Generator, copy: bool, input_norm: bool = True) -> dict[str, torch.Tensor]:
    w = {
        f"{prefix}self_attn.q_proj.weight": _rand(g, heads * head_dim, in_dim),
        f"{prefix}self_attn.k_proj.weight": _rand(g, kv_heads * head_dim, in_dim),
        f"{prefix}self_attn.v_proj.weight": _rand(g, kv_heads * head_dim, in_dim),
        f"{prefix}self_attn.o_proj.weight": _rand(g, h, heads * head_dim),
        f"{prefix}mlp.gate_proj.weight": _rand(g, inter, h),
        f"{prefix}mlp.up_proj.weight": _rand(g, inter, h),
        f"{prefix}mlp.down_proj.weight": _rand(g, h, inter),
        f"{prefix}post_attention_layernorm.weight": torch.ones(h) if copy else 1 + _rand(g, h),
    }
    if input_norm:
        w[f"{prefix}input_layernorm.weight"] = torch.ones(h) if copy else 1 + _rand(g, h)
    if copy:
        w[f"{prefix}self_attn.o_proj.weight"].zero_()
        w[f"{prefix}mlp.down_proj.weight"].zero_()
    return w


def _head_config(tcfg: dict, **kw) -> dict:
    cfg = {k: tcfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                "rms_norm_eps", "vocab_size", "max_position_embeddings")}
    cfg.update(model_type="llama", num_hidden_layers=1, hidden_act="silu", tie_word_embeddings=False,
               torch_dtype="float32", **kw)
    return cfg


def _write(path, cfg: dict, w: dict[str, torch.Tensor]) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def write_eagle_head(path, target_dir, copy: bool = True, seed: int = 0) -> Path:
    """EAGLE-1: fc [H, 2H] over cat(embedding, feature), layers.0.* without input_layernorm. copy=True: fc
    keeps the embedding, the layer adds nothing, no embed_tokens (the target's); else random with its own
    embed_tokens and fc.bias."""
    tcfg, tw = _target(target_dir)
    h, g = tcfg["hidden_size"], torch.Generator().manual_seed(seed)
    heads, kv = tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    w = _llama_layer("layers.0.", h, tcfg["intermediate_size"], heads, kv, h // heads, h, g, copy, input_norm=False)
    if copy:
        w["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    else:
        w["fc.weight"] = _rand(g, h, 2 * h)
        w["fc.bias"] = _rand(g, h)
        w["embed_tokens.weight"] = _rand(g, tcfg["vocab_size"], h, std=0.5)
    return _write(path, _head_config(tcfg, architectures=["LlamaForCausalLMEagle"]), w)


def write_eagle3_head(path, target_dir, copy: bool = True, draft_tokens: list[int] | None = None,
                      seed: int = 0) -> Path:
    """EAGLE-3: fc [H, 3H], midlayer.* (q/k/v over 2H), norm, lm_head [draft_vocab, H], d2t, t2d.
    `draft_tokens`: the target ids of the draft vocabulary (ascending; None: all). copy=True: one
    attention head of width H whose rotary scores pick the query's own position, v = the normed
    embedding, o = identity, fc = 0, and lm_head = the target's rows."""
    tcfg, tw = _target(target_dir)
    h, inter, vocab = tcfg["hidden_size"], tcfg["intermediate_size"], tcfg["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    ids = torch.arange(vocab) if draft_tokens is None else torch.tensor(sorted(draft_tokens))
    if copy:
        heads = kv = 1
        head_dim = h
    else:
        heads, kv = tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
        head_dim = h // heads
    w = {f"midlayer.{k}": v for k, v in _llama_layer("", h, inter, heads, kv, head_dim, 2 * h, g, copy).items()}
    w["midlayer.hidden_norm.weight"] = torch.ones(h) if copy else 1 + _rand(g, h)
    w["norm.weight"] = torch.ones(h) if copy else 1 + _rand(g, h)
    if copy:
        pick = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)  # the embedding half
        for p, scale in (("q", 4.0), ("k", 4.0), ("v", 1.0)):
            w[f"midlayer.self_attn.{p}_proj.weight"] = pick * scale
        w["midlayer.self_attn.o_proj.weight"] = torch.eye(h)
        w["fc.weight"] = torch.zeros(h, 3 * h)
        w["lm_head.weight"] = tw["lm_head.weight"][ids].clone()
    else:
        w["fc.weight"] = _rand(g, h, 3 * h)
        w["lm_head.weight"] = _rand(g, len(ids), h)
    w["d2t"] = ids - torch.arange(len(ids))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    w["t2d"] = t2d
    cfg = _head_config(tcfg, architectures=["LlamaForCausalLMEagle3"], num_attention_heads=heads,
                       num_key_value_heads=kv, head_dim=head_dim, draft_vocab_size=len(ids),
                       eagle_config={"eagle_aux_hidden_state_layer_ids": EAGLE3_AUX_IDS})
    return _write(path, cfg, w)


def add_mtp_layers(target_dir, copy: bool = True, seed: int = 0) -> Path:
    """Add DeepSeek-V3 style MTP tensors model.layers.{N}.* to the target's checkpoint (in place) and set
    num_nextn_predict_layers = 1. copy=True: eh_proj keeps the embedding half, the block adds nothing, no
    shared_head.head / embed_tokens (the target's); else random, with copies of the target's embedding and head."""
    target_dir = Path(target_dir)
    tcfg, tw = _target(target_dir)
    h, n = tcfg["hidden_size"], tcfg["num_hidden_layers"]
    heads, kv = tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    head_dim = tcfg.get("head_dim") or h // heads
    g = torch.Generator().manual_seed(seed)
    pre = f"model.layers.{n}."
    w = _llama_layer(pre, h, tcfg["intermediate_size"], heads, kv, head_dim, h, g, copy)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        w[f"{pre}{norm}.weight"] = torch.ones(h) if copy else 1 + _rand(g, h)
    if copy:
        w[f"{pre}eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    else:
        w[f"{pre}eh_proj.weight"] = _rand(g, h, 2 * h)
        w[f"{pre}embed_tokens.weight"] = tw["model.embed_tokens.weight"].clone()
        w[f"{pre}shared_head.head.weight"] = tw.get("lm_head.weight", tw["model.embed_tokens.weight"]).clone()
    tw.update(w)
    save_file({k: v.contiguous() for k, v in tw.items()}, str(target_dir / "model.safetensors"),
              metadata={"format": "pt"})
    tcfg["num_nextn_predict_layers"] = 1
    (target_dir / "config.json").write_text(json.dumps(tcfg, indent=1))
    return target_dir


class PagedSequence:
    """One sequence in a paged KV cache, for a set of attention layers (a target's or a head's): its own
    backend instance, blocks in a shuffled order."""

    def __init__(self, layers, num_blocks: int = 12, block_size: int = 4, backend: str | None = None) -> None:
        from tokenmill.layers.attention_backends.registry import get_attention_backend

        self.backend = get_attention_backend(backend, "cpu")(block_size, torch.device("cpu"))
        self.backend.allocate_kv_cache(layers, num_blocks, torch.float32)
        self.block_size = block_size
        self.blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))

    def meta(self, start: int, n: int):
        """Metadata for positions start..start+n-1 (the cache holds 0..start-1)."""
        from tokenmill.layers.attention_backends.base import BatchLayout

        bs = self.block_size
        pos = torch.arange(start, start + n)
        used = -(-(start + n) // bs)
        layout = BatchLayout(
            query_start=torch.tensor([0]), query_len=torch.tensor([n]), kv_len=torch.tensor([start + n]),
            block_table=self.blocks[:used].unsqueeze(0).clone(), slot_mapping=self.blocks[pos // bs] * bs + pos % bs,
            num_tokens=n, max_query_len=n, max_kv_len=start + n)
        return self.backend.build_metadata(layout)
