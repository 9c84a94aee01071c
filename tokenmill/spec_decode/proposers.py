"""The speculative proposers by method name: `--speculative-config {"method": ...}` picks one here.

A proposer is registered with the kind of cost it has, which the adaptive policy models (adaptive.py):
- "lookup": drafting is one call whose wall time is measured per step (n-gram lookup, Medusa heads: a few
  matmuls over the rows the target just computed); the drafter has `propose(view, want, k)` and `forget(rid)`;
- "model" / "head": a draft with its own forwards and KV (spec_decode/draft.py's DraftRunner): a model that
  catches up only while drafting, or an EAGLE/MTP head that catches up on every verified position; each forward
  measured.

Adding a method: a function that builds the drafter from a `ProposerContext`, decorated with `@proposer(name,
kind)`, and the name in config.SPEC_METHODS (the engine validates names without importing torch).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from tokenmill.config import SpeculativeConfig
from tokenmill.spec_decode.eagle_tree import TreeShape
from tokenmill.spec_decode.tree import windowed

log = logging.getLogger(__name__)

KINDS = ("lookup", "model", "head")


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer may need to build its drafter."""

    spec: SpeculativeConfig
    config: object  # EngineConfig
    target: torch.nn.Module
    backend_cls: type  # the target's attention backend class (a draft with KV gets its own instance)
    block_size: int
    device: torch.device
    vocab_size: int
    max_model_len: int


@dataclass(frozen=True)
class Proposer:
    name: str
    kind: str
    build: Callable[[ProposerContext], object]


PROPOSERS: dict[str, Proposer] = {}


def proposer(name: str, kind: str):
    if kind not in KINDS:
        raise ValueError(f"proposer kind must be one of {KINDS}, got {kind!r}")

    def register(build: Callable[[ProposerContext], object]) -> Callable[[ProposerContext], object]:
        PROPOSERS[name] = Proposer(name, kind, build)
        return build

    return register


def get_proposer(name: str) -> Proposer:
    if name not in PROPOSERS:
        raise ValueError(f"unknown speculative method {name!r}; known: {', '.join(sorted(PROPOSERS))}.")
    return PROPOSERS[name]


# ---- the methods -------------------------------------------------------------------------------
@proposer("ngram", "lookup")
def _ngram(ctx: ProposerContext):
    from tokenmill.spec_decode.ngram import NgramDrafter

    return NgramDrafter(ctx.spec.prompt_lookup_min, ctx.spec.prompt_lookup_max)


def _draft_model(ctx: ProposerContext, path: str, quant_method: str | None, warn_vocab: bool):
    from tokenmill.layers.quantization import get_quantization_config
    from tokenmill.model.loader import load_model
    from tokenmill.spec_decode.draft import DraftRunner

    mc = ctx.config.model
    quant = get_quantization_config(quant_method, mc.quantization_group_size, model=path, device=str(ctx.device),
                                    activations=mc.activation_quantization, batch_dtype=mc.quantized_batch_dtype)
    module, draft_cfg, _ = load_model(path, mc.dtype, ctx.max_model_len, str(ctx.device), quant_config=quant)
    draft_vocab = int(draft_cfg.vocab_size)
    if warn_vocab and draft_vocab < ctx.vocab_size:
        log.warning("draft vocabulary %d is smaller than the target's %d: drafts never use the rest",
                    draft_vocab, ctx.vocab_size)
    module.eval()
    return DraftRunner(module, ctx.backend_cls(ctx.block_size, ctx.device), ctx.block_size, ctx.device,
                       ctx.vocab_size, ctx.max_model_len, head=False)


@proposer("draft_model", "model")
def _draft(ctx: ProposerContext):
    return _draft_model(ctx, ctx.spec.model, ctx.spec.quantization, warn_vocab=True)


@proposer("quantized_self", "model")
def _quantized_self(ctx: ProposerContext):
    return _draft_model(ctx, ctx.config.model.model, ctx.spec.quantization or "int4", warn_vocab=False)


def _head(ctx: ProposerContext):
    from tokenmill.spec_decode.draft import DraftRunner
    from tokenmill.spec_decode.heads import load_draft_head

    mc, target = ctx.config.model, ctx.target
    module = load_draft_head(ctx.spec.method, ctx.spec.model, target, mc.model, target.storage_dtype,
                             target.compute_dtype, ctx.max_model_len)
    if module.aux_layers:
        target.aux_hidden_layers = tuple(module.aux_layers)
    module.eval()
    runner = DraftRunner(module, ctx.backend_cls(ctx.block_size, ctx.device), ctx.block_size, ctx.device,
                         ctx.vocab_size, ctx.max_model_len, head=True)
    if ctx.spec.tree_topk > 1:
        if windowed(target):
            log.warning("EAGLE-2 draft trees: the target has sliding-window layers; drafting chains instead")
        else:
            runner.tree = TreeShape(ctx.spec.tree_topk, ctx.spec.tree_depth)
    return runner


for _name in ("eagle", "eagle3", "mtp"):
    proposer(_name, "head")(_head)


@proposer("medusa", "lookup")
def _medusa(ctx: ProposerContext):
    from tokenmill.spec_decode.medusa import MedusaDrafter, load_medusa

    target = ctx.target
    heads = load_medusa(ctx.spec.model, target.spec.hidden_size, ctx.vocab_size, target.compute_dtype).to(ctx.device)
    if heads.proj is None:  # heads sharing the target's LM head (as `tokenmill train-medusa` writes them)
        heads.lm_head = target.lm_head.compute_logits
    return MedusaDrafter(heads, ctx.spec.medusa_choices, trees=not windowed(target))


@proposer("dflash", "lookup")
def _dflash(ctx: ProposerContext):
    from tokenmill.spec_decode.dflash import BlockDrafterProposer, load_block_drafter

    target = ctx.target
    if target.embed_tokens is None:
        raise ValueError("dflash: the drafter needs the target's embedding on the last pipeline stage")
    drafter = load_block_drafter(ctx.spec.model, target.spec.hidden_size, ctx.vocab_size, target.compute_dtype)
    embed = lambda ids: target.embed_tokens(ids).to(target.compute_dtype)  # noqa: E731
    return BlockDrafterProposer(drafter.to(ctx.device), embed, target.lm_head.compute_logits, ctx.spec.block_threshold)
