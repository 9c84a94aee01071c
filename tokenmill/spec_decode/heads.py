"""Draft heads over the target's hidden states (speculative decoding, issue 13): EAGLE, EAGLE-3, MTP.

Convention (vLLM's): at position p a head reads token t_{p+1} and feature f_p, writes its KV at p's
slot and predicts t_{p+2}; the first step's feature is the target's, later steps feed back the head's
own feature output. Checkpoint layouts read (H = hidden size, names after an optional "model."):

- eagle (EAGLE-1, e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B): its own folder, config.json a LlamaConfig.
  `fc.weight [H, 2H]` (+ optional `fc.bias`) over cat(embedding, feature); Llama decoder layers
  `layers.{i}.*`, layer 0 without input_layernorm; optional `embed_tokens.weight`; no final norm, the
  target's LM head. Feature: the target's final hidden state (after its norm). Output = next feature.
- eagle3 (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): its own folder. `fc.weight [H, 3H]` over the
  target's residual stream at three layers (first step only); `midlayer.*` (or `layers.0.*`):
  input_layernorm (embedding), hidden_norm (feature), q/k/v over their 2H-wide concat, o_proj,
  post_attention_layernorm, mlp; `norm.weight`; `lm_head.weight [draft_vocab, H]`; `d2t [draft_vocab]`
  (target id - draft id); `t2d` ignored. Layer ids from config `eagle_config.eagle_aux_hidden_state_layer_ids`
  else (2, N//2, N-3), vLLM's numbering (id i = the stream entering layer i, i.e. after layer i-1).
  Next feature = the pre-norm output; logits from `norm`.
- mtp (DeepSeek-V3): inside the target's checkpoint under `model.layers.{N}.` (N = num_hidden_layers,
  config num_nextn_predict_layers >= 1): enorm, hnorm, `eh_proj [H, 2H]` over cat(enorm(embedding),
  hnorm(feature)), a decoder layer like the target's, `shared_head.norm`, optional `shared_head.head`
  and `embed_tokens` (else the target's). Feature: the target's final hidden state; next feature = the
  layer output before shared_head.norm.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from tokenmill.layers.attention import Attention
from tokenmill.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.layers.linear import QKVParallelLinear, ReplicatedLinear
from tokenmill.layers.moe import FusedMoE
from tokenmill.layers.rotary import RotaryEmbedding, rope_inv_freq
from tokenmill.model.blocks import (AttentionBlock, Build, DecoderForCausalLM, DecoderLayer, DecoderSpec, LayerSpec,
                                    MLPBlock)
from tokenmill.model.hf_config import hf_get
from tokenmill.model.weights import WeightNaming, _expected_names, load_weights

METHODS = ("eagle", "eagle3", "mtp")
_DECODER_PARTS = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.",
                  "pre_feedforward_layernorm.", "post_feedforward_layernorm.")


class DraftHead(nn.Module):
    """forward(input_ids [T], positions [T], features [T, F], meta) -> (next feature [T, H], hidden [T, H]);
    compute_logits(hidden) -> float32 [T, target vocab]. Embedding / LM head may be the target's modules."""

    method: str = ""
    aux_layers: tuple[int, ...] = ()  # () = the target's final hidden states; else DecoderForCausalLM.aux_hidden_layers
    packed_modules_mapping = DecoderForCausalLM.packed_modules_mapping

    def __init__(self, spec: DecoderSpec, build: Build) -> None:
        super().__init__()
        self.hidden_size = spec.hidden_size
        self.vocab_size = spec.vocab_size
        self.compute_dtype = build.compute_dtype
        self.embed_tokens: VocabParallelEmbedding | None = None
        self.lm_head: ParallelLMHead | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids).to(self.compute_dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

    def share_target(self, target: DecoderForCausalLM) -> None:
        """Use the target's embedding / LM head where the checkpoint has none (after loading)."""
        if self.embed_tokens is None:
            self.embed_tokens = target.embed_tokens
        if self.lm_head is None:
            self.lm_head = target.lm_head


class _NoNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class EagleHead(DraftHead):
    method = "eagle"

    def __init__(self, spec: DecoderSpec, rotary: RotaryEmbedding, build: Build, fc_bias: bool,
                 own_embedding: bool) -> None:
        super().__init__(spec, build)
        h = spec.hidden_size
        if own_embedding:
            self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, h, build.params_dtype)
        self.fc = ReplicatedLinear(2 * h, h, fc_bias, **build.linear("fc"))
        self.layers = nn.ModuleList(DecoderLayer(spec, layer, rotary, build, f"layers.{i}")
                                    for i, layer in enumerate(spec.layers))
        self.layers[0].input_layernorm = _NoNorm()

    def forward(self, input_ids, positions, features, meta) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fc(torch.cat([self.embed(input_ids), features.to(self.compute_dtype)], dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, meta, residual)
        h = x + residual
        return h, h


class Eagle3Layer(nn.Module):
    """Llama layer whose attention reads cat(input_layernorm(embedding), hidden_norm(feature)) [2H]."""

    def __init__(self, spec: DecoderSpec, rotary: RotaryEmbedding, build: Build, prefix: str) -> None:
        super().__init__()
        h, a = spec.hidden_size, spec.attention
        self.input_layernorm = build.norm(h, spec)
        self.hidden_norm = build.norm(h, spec)
        self.self_attn = AttentionBlock(spec, rotary, None, build, f"{prefix}.self_attn")
        self.self_attn.qkv_proj = QKVParallelLinear(2 * h, a.head_dim, a.num_heads, a.num_kv_heads, a.qkv_bias,
                                                    **build.linear(f"{prefix}.self_attn.qkv_proj"))
        self.post_attention_layernorm = build.norm(h, spec)
        self.mlp = MLPBlock(spec, build, f"{prefix}.mlp")

    def forward(self, positions, embeds, hidden, meta) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        residual, x = self.post_attention_layernorm.add(hidden, self.self_attn(positions, x, meta))
        return self.mlp(x), residual


class Eagle3Head(DraftHead):
    method = "eagle3"

    def __init__(self, spec: DecoderSpec, rotary: RotaryEmbedding, build: Build, aux_layers: tuple[int, ...],
                 draft_vocab: int, own_embedding: bool, own_lm_head: bool) -> None:
        super().__init__(spec, build)
        h = spec.hidden_size
        self.aux_layers = aux_layers
        if own_embedding:
            self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, h, build.params_dtype)
        self.fc = ReplicatedLinear(len(aux_layers) * h, h, False, **build.linear("fc"))
        self.midlayer = Eagle3Layer(spec, rotary, build, "midlayer")
        self.norm = build.norm(h, spec)
        if own_lm_head:
            self.lm_head = ParallelLMHead(draft_vocab, h, build.params_dtype)
        self.draft_vocab = draft_vocab
        self.register_buffer("draft_to_target", None, persistent=False)  # [draft_vocab] target ids; None: identity

    def forward(self, input_ids, positions, features, meta) -> tuple[torch.Tensor, torch.Tensor]:
        features = features.to(self.compute_dtype)
        if features.shape[-1] != self.hidden_size:  # the target's aux states (first step)
            features = self.fc(features)
        x, residual = self.midlayer(positions, self.embed(input_ids), features, meta)
        return self.norm.add(residual, x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        if self.draft_to_target is None:
            return logits
        out = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        return out.index_copy_(1, self.draft_to_target, logits)


class _SharedHead(nn.Module):
    def __init__(self, norm: nn.Module, head: ParallelLMHead | None) -> None:
        super().__init__()
        self.norm = norm
        self.head = head


class MTPHead(DraftHead):
    method = "mtp"

    def __init__(self, spec: DecoderSpec, rotary: RotaryEmbedding, build: Build, own_embedding: bool,
                 own_head: bool, layer_class: type[nn.Module] = DecoderLayer) -> None:
        super().__init__(spec, build)
        h = spec.hidden_size
        if own_embedding:
            self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, h, build.params_dtype)
        self.enorm = build.norm(h, spec)
        self.hnorm = build.norm(h, spec)
        self.eh_proj = ReplicatedLinear(2 * h, h, False, **build.linear("eh_proj"))
        self.block = layer_class(spec, LayerSpec(), rotary, build, "block")  # the target's kind (DeepSeek: MLA + MoE)
        self.shared_head = _SharedHead(build.norm(h, spec),
                                       ParallelLMHead(spec.vocab_size, h, build.params_dtype) if own_head else None)

    def forward(self, input_ids, positions, features, meta) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.enorm(self.embed(input_ids))
        x = self.eh_proj(torch.cat([e, self.hnorm(features.to(self.compute_dtype))], dim=-1))
        x, residual = self.block(positions, x, meta)
        h = x + residual
        return h, self.shared_head.norm(h)

    def share_target(self, target: DecoderForCausalLM) -> None:
        if self.shared_head.head is not None:
            self.lm_head = self.shared_head.head
        super().share_target(target)


# ---- loading ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class _HeadNaming(WeightNaming):
    """Checkpoint name -> head parameter name: drop `prefix` (names without it are not the head's), then
    the first matching (checkpoint prefix, parameter prefix) rename; only names under `keep` load."""

    prefix: str = ""
    renames: tuple[tuple[str, str], ...] = ()
    keep: tuple[str, ...] = ()

    def param_name(self, name: str, tied: bool = False) -> str | None:
        if not name.startswith(self.prefix):
            return None
        name = name[len(self.prefix):]
        for old, new in self.renames:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        if "rotary_emb." in name or name.split(".")[0] not in self.keep:
            return None
        return name

    def checkpoint_name(self, param: str) -> str:
        for old, new in self.renames:
            if new and param.startswith(new):
                return self.prefix + old + param[len(new):]
        return self.prefix + param


def _tensor_files(path: str, what: str) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the names only (nothing is read)."""
    from safetensors import safe_open

    from tokenmill.model.loader import safetensors_files

    try:
        files = safetensors_files(path)
    except FileNotFoundError as e:
        raise ValueError(f"{what}: {e}") from None
    names: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            names.update((n, f) for n in st.keys())
    return names


def _read(files: dict[str, Path], names: list[str], dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(files[n], []).append(n)
    for f, ns in by_file.items():
        with safe_open(str(f), framework="pt") as st:
            for n in ns:
                t = st.get_tensor(n)
                yield n, t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _load(head: DraftHead, files: dict[str, Path], naming: _HeadNaming, dtype: torch.dtype, what: str) -> None:
    ours = {n: p for n in files if (p := naming.param_name(n)) is not None}
    # Stacked experts (a MoE block's FusedMoE) are checked by load_weights, per expert tensor.
    experts = {f"{name}." for name, m in head.named_modules() if isinstance(m, FusedMoE)}
    params = {n: p for n, p in head.named_parameters() if not any(n.startswith(e) for e in experts)}
    expected = _expected_names(params, head.packed_modules_mapping)
    missing = sorted(naming.checkpoint_name(n) for n in expected - set(ours.values()))
    if missing:
        raise ValueError(f"{what} is missing tensors: {', '.join(missing)}")
    head.weight_naming = naming
    try:
        load_weights(head, _read(files, list(ours), dtype))
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def _head_config(path: str):
    from transformers import LlamaConfig

    f = Path(path) / "config.json"
    if not f.is_file():
        raise ValueError(f"draft head folder {path!r} has no config.json")
    raw = json.loads(f.read_text())
    raw.pop("model_type", None)
    try:
        return LlamaConfig(**raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"draft head config {f}: {e}") from None


def _head_spec(cfg, target: DecoderForCausalLM, what: str) -> DecoderSpec:
    from tokenmill.model.llama import llama_spec

    for key, want in (("hidden_size", target.spec.hidden_size), ("vocab_size", target.spec.vocab_size)):
        if hf_get(cfg, key) != want:
            raise ValueError(f"{what}: config {key} {hf_get(cfg, key)} differs from the target's {want}")
    try:
        return llama_spec(cfg)
    except (AttributeError, TypeError) as e:
        raise ValueError(f"{what}: config.json is not a Llama config: {e}") from None


def eagle3_aux_layers(cfg, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose output stream EAGLE-3 reads (tokenmill's numbering: after layer i, -1 =
    the embeddings), from the config's vLLM-numbered ids or vLLM's default (2, N//2, N-3)."""
    n = num_target_layers
    ids = (hf_get(cfg, "eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (2, n // 2, n - 3)
    if not all(0 <= int(i) <= n for i in ids):
        raise ValueError(f"EAGLE-3 aux hidden state layer ids {list(ids)} do not fit the target's {n} layers "
                         f"(id i = the hidden state entering layer i); "
                         f"set eagle_config.eagle_aux_hidden_state_layer_ids")
    return tuple(int(i) - 1 for i in ids)


def load_draft_head(method: str, path: str | None, target: DecoderForCausalLM, target_path: str,
                    dtype: torch.dtype, compute_dtype: torch.dtype, max_positions: int) -> DraftHead:
    """eagle/eagle3: `path` is the head's own folder; mtp: the weights are in the target's (`target_path`).
    The head is built on the target's device; missing embedding / LM head are the target's modules."""
    if method not in METHODS:
        raise ValueError(f"unknown draft head method {method!r}; valid: {', '.join(METHODS)}")
    build = Build(dtype, compute_dtype)
    device = next(target.parameters()).device
    with torch.device(device):
        if method == "mtp":
            head = _load_mtp(target, target_path, build)
        else:
            if not path:
                raise ValueError(f"speculative method {method!r} needs the draft head's folder")
            head = _load_eagle(method, path, target, build, max_positions)
    head.share_target(target)
    return head.eval()


def _load_eagle(method: str, path: str, target: DecoderForCausalLM, build: Build, max_positions: int) -> DraftHead:
    what = f"{method} head folder {path!r}"
    cfg = _head_config(path)
    spec = _head_spec(cfg, target, what)
    inv_freq, scaling = rope_inv_freq(cfg, spec.attention.head_dim)
    rotary = RotaryEmbedding(inv_freq, max_positions, scaling)
    files = _tensor_files(path, what)
    names = {n.removeprefix("model.") for n in files}
    own_embedding = "embed_tokens.weight" in names
    if method == "eagle":
        head = EagleHead(spec, rotary, build, "fc.bias" in names, own_embedding)
        naming = _HeadNaming(renames=(("model.", ""),), keep=("fc", "layers", "embed_tokens"))
        _load(head, files, naming, build.params_dtype, what)
        return head
    # getattr: a transformers config; only some heads have draft_vocab_size
    draft_vocab = int(hf_get(cfg, "draft_vocab_size") or cfg.vocab_size)
    own_lm_head = "lm_head.weight" in names
    if not own_lm_head and draft_vocab != cfg.vocab_size:
        raise ValueError(f"{what} is missing tensors: lm_head.weight (draft_vocab_size {draft_vocab})")
    head = Eagle3Head(spec, rotary, build, eagle3_aux_layers(cfg, len(target.layers)), draft_vocab,
                      own_embedding, own_lm_head)
    naming = _HeadNaming(renames=(("midlayer.", "midlayer."), ("model.layers.0.", "midlayer."),
                                  ("layers.0.", "midlayer."), ("model.", "")),
                         keep=("fc", "midlayer", "norm", "lm_head", "embed_tokens"))
    _load(head, files, naming, build.params_dtype, what)
    d2t_name = next((n for n in files if n.removeprefix("model.") == "d2t"), None)
    if d2t_name is None:
        if draft_vocab != cfg.vocab_size:
            raise ValueError(f"{what} is missing tensors: d2t (draft_vocab_size {draft_vocab} < vocab_size)")
        return head
    d2t = next(_read(files, [d2t_name], None))[1]
    if tuple(d2t.shape) != (draft_vocab,):
        raise ValueError(f"{what}: d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab},)")
    ids = torch.arange(draft_vocab) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size or ids.unique().numel() != draft_vocab:
        raise ValueError(f"{what}: d2t maps draft ids outside the target vocabulary or twice")
    if draft_vocab != cfg.vocab_size or bool(d2t.any()):
        head.draft_to_target = ids.to(next(head.parameters()).device)
    return head


def _load_mtp(target: DecoderForCausalLM, target_path: str, build: Build) -> DraftHead:
    cfg = target.config
    # getattr: a transformers config; only MTP checkpoints have num_nextn_predict_layers
    if int(hf_get(cfg, "num_nextn_predict_layers", 0) or 0) < 1:
        raise ValueError(f"target {target_path!r} has no MTP layers: "
                         f"config.json sets no num_nextn_predict_layers >= 1")
    n = cfg.num_hidden_layers
    prefix = f"model.layers.{n}."
    what = f"MTP layer {prefix}* in {target_path!r}"
    files = _tensor_files(target_path, what)
    head = MTPHead(target.spec, target.layers[0].self_attn.rotary, build, f"{prefix}embed_tokens.weight" in files,
                   f"{prefix}shared_head.head.weight" in files, type(target).decoder_layer)
    naming = _HeadNaming(prefix=prefix, renames=tuple((p, "block." + p) for p in _DECODER_PARTS),
                         keep=("enorm", "hnorm", "eh_proj", "block", "shared_head", "embed_tokens"))
    _load(head, files, naming, build.params_dtype, what)
    return head
