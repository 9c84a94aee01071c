"""The worker's speculative decoder: after each step it proposes the next step's drafts, keeps the draft
distributions the rejection sampler will need, and decides (adaptive.py) how many drafts are worth it."""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from tokenmill.config import EngineConfig, SpeculativeConfig
from tokenmill.spec_decode.adaptive import AdaptivePolicy
from tokenmill.spec_decode.draft import Draft, DraftRunner, StepView
from tokenmill.spec_decode.ngram import NgramProposer

log = logging.getLogger(__name__)


class NgramDrafter:
    """Prompt lookup over each request's tokens, kept in a growing numpy buffer (no list copy per step)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.proposer = NgramProposer(min_n, max_n)
        self.history: dict[str, tuple[np.ndarray, int]] = {}

    def _tokens(self, view: StepView, i: int) -> np.ndarray:
        """Request i's tokens as a numpy view; only those new since the last step are copied in."""
        rid, total = view.requests[i].req_id, view.length(i)
        buf, n = self.history.get(rid, (None, 0))
        if buf is None or n > total:
            buf, n = np.empty(max(64, 2 * total), dtype=np.int64), 0
        if total > buf.size:
            grown = np.empty(2 * total, dtype=np.int64)
            grown[:n] = buf[:n]
            buf = grown
        buf[n:total] = view.tokens(i, n, total)
        self.history[rid] = (buf, total)
        return buf[:total]

    def forget(self, rid: str) -> None:
        self.history.pop(rid, None)

    def propose(self, view: StepView, want: set[int], k: int) -> dict[int, Draft]:
        out = {}
        for i in want:
            drafts = self.proposer.propose(self._tokens(view, i), k)
            if drafts:
                out[i] = Draft(drafts, None)
        return out


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, drafter) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.drafter = drafter  # NgramDrafter or DraftRunner
        kind = "lookup" if not isinstance(drafter, DraftRunner) else "head" if drafter.head else "model"
        self.policy = AdaptivePolicy(self.k, config.adaptive, config.disable_by_batch_size, kind)
        self.draft_probs: dict[str, torch.Tensor] = {}  # request -> [k, V] q of its pending random drafts
        # Cost bookkeeping for the policy: the first target forward and the draft's first forward carry
        # one-time setup and are not measurements; the step period minus the forward and the drafting is
        # the per-step overhead (not when it is 10x the work: then the engine was idle, waiting for requests).
        self._seen_forward = False
        self._seen_draft = False
        self._last_observe: float | None = None
        self._propose_s = 0.0
        self._batch = 0

    @property
    def last_k(self) -> int:
        """The drafts per request chosen for the next step (0: off)."""
        return self.policy.last_k

    @property
    def runner(self) -> DraftRunner | None:
        return self.drafter if isinstance(self.drafter, DraftRunner) else None

    # ---- KV of a draft model or head -------------------------------------------------------
    def block_bytes(self, kv_dtype: torch.dtype) -> int:
        return self.runner.block_bytes(kv_dtype) if self.runner else 0

    def allocate_kv_cache(self, num_blocks: int, kv_dtype: torch.dtype) -> None:
        if self.runner:
            self.runner.allocate_kv_cache(num_blocks, kv_dtype)

    def kv_caches(self) -> list[torch.Tensor]:
        return self.runner.kv_caches() if self.runner else []

    def mark_initialized(self, block_ids: torch.Tensor) -> None:
        if self.runner:
            self.runner.backend.mark_initialized(block_ids)

    # ---- per step ----------------------------------------------------------------------------
    def forget(self, rid: str) -> None:
        self.draft_probs.pop(rid, None)
        self.drafter.forget(rid)

    def probs_for(self, rid: str, num_drafts: int) -> torch.Tensor | None:
        q = self.draft_probs.pop(rid, None)
        return q[:num_drafts] if q is not None else None

    def observe(self, num_tokens: int, forward_s: float, verified: list[tuple[int, int]]) -> None:
        """A target step ran: its forward over num_tokens took forward_s; `verified` is (drafted, accepted)
        per request that verified drafts."""
        now = time.perf_counter()
        policy = self.policy
        if self._seen_forward:
            policy.forward.observe(num_tokens, forward_s)
            work = forward_s + self._propose_s
            gap = now - self._last_observe - work if self._last_observe is not None else None
            if gap is not None and self._batch and gap < 10 * work:  # longer: the engine sat idle between steps
                policy.observe_overhead(self._batch, gap)
        self._seen_forward = True
        self._last_observe = now
        for drafted, accepted in verified:
            policy.observe_verification(drafted, accepted)

    def propose(self, view: StepView) -> dict[str, list[int]]:
        t0 = time.perf_counter()
        sampled = [i for i, got in enumerate(view.accepted) if got]
        k = self.policy.choose(len(sampled))
        want = set(sampled)
        runner = self.runner
        if runner is not None:
            drafts = runner.propose(view, want if k else set(), k, catch_up_all=bool(k) or runner.head)
            for tokens, seconds in runner.timings:
                if self._seen_draft:
                    self.policy.observe_draft_forward(tokens, seconds)
                self._seen_draft = True
        else:
            drafts = self.drafter.propose(view, want, k) if k else {}
            if k:
                self.policy.observe_lookup(len(want), time.perf_counter() - t0)
        out = {}
        for i, d in drafts.items():
            rid = view.requests[i].req_id
            out[rid] = d.token_ids
            if d.probs is not None:
                self.draft_probs[rid] = d.probs
        self._batch = len(sampled)
        self._propose_s = time.perf_counter() - t0
        return out


def build_spec_decoder(config: EngineConfig, target: torch.nn.Module, backend_cls, block_size: int,
                       device: torch.device, vocab_size: int, max_model_len: int) -> SpecDecoder | None:
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        return SpecDecoder(spec, NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max))
    mc = config.model
    if spec.method in ("draft_model", "quantized_self"):
        from tokenmill.layers.quantization import get_quantization_config
        from tokenmill.model.loader import load_model

        path = mc.model if spec.method == "quantized_self" else spec.model
        method = spec.quantization or ("int4" if spec.method == "quantized_self" else None)
        quant = get_quantization_config(method, mc.quantization_group_size, model=path, device=str(device),
                                        activations=mc.activation_quantization)
        module, draft_cfg, _ = load_model(path, mc.dtype, max_model_len, str(device), quant_config=quant)
        draft_vocab = int(draft_cfg.vocab_size)
        if draft_vocab < vocab_size and spec.method == "draft_model":
            log.warning("draft vocabulary %d is smaller than the target's %d: drafts never use the rest",
                        draft_vocab, vocab_size)
        head = False
    else:
        from tokenmill.spec_decode.heads import load_draft_head

        module = load_draft_head(spec.method, spec.model, target, mc.model, target.storage_dtype,
                                 target.compute_dtype, max_model_len)
        if module.aux_layers:
            target.aux_hidden_layers = tuple(module.aux_layers)
        head = True
    module.eval()
    runner = DraftRunner(module, backend_cls(block_size, device), block_size, device, vocab_size, max_model_len, head)
    log.info("speculative decoding: %s, k=%d%s", spec.method, spec.num_speculative_tokens,
             "" if spec.adaptive else " (fixed)")
    return SpecDecoder(spec, runner)
