"""The worker's speculative decoder: after each step it proposes the next step's drafts, keeps the draft
distributions the rejection sampler will need, and decides (adaptive.py) how many drafts are worth it."""
from __future__ import annotations

import logging
import time

import torch

from tokenmill.config import EngineConfig, SpeculativeConfig
from tokenmill.spec_decode.adaptive import AdaptivePolicy
from tokenmill.spec_decode.draft import DraftRunner, StepView
from tokenmill.spec_decode.proposers import ProposerContext, get_proposer
from tokenmill.testing import faults

log = logging.getLogger(__name__)


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, drafter, kind: str) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.drafter = drafter  # a DraftRunner (kinds "model", "head"), else a lookup drafter (proposers.py)
        tree = drafter.tree if isinstance(drafter, DraftRunner) else None  # an EAGLE-2 tree's shape: drafting cost
        self.policy = AdaptivePolicy(self.k, config.adaptive, config.disable_by_batch_size, kind, drafter.shape,
                                     tree.width if tree else 1, tree.depth if tree else 1)
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

    def propose(self, view: StepView) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """The next step's drafts per request, and the parents of those that are trees."""
        t0 = time.perf_counter()
        sampled = [i for i, got in enumerate(view.accepted) if got]
        faults.maybe_raise("propose", (view.requests[i].req_id for i in sampled))
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
        out, trees = {}, {}
        for i, d in drafts.items():
            rid = view.requests[i].req_id
            out[rid] = d.token_ids
            if d.probs is not None:
                self.draft_probs[rid] = d.probs
            if d.parents is not None:
                trees[rid] = d.parents
        self._batch = len(sampled)
        self._propose_s = time.perf_counter() - t0
        return out, trees


def build_spec_decoder(config: EngineConfig, target: torch.nn.Module, backend_cls, block_size: int,
                       device: torch.device, vocab_size: int, max_model_len: int) -> SpecDecoder | None:
    spec = config.speculative
    if spec is None:
        return None
    entry = get_proposer(spec.method)
    drafter = entry.build(ProposerContext(spec, config, target, backend_cls, block_size, device, vocab_size,
                                          max_model_len))
    log.info("speculative decoding: %s, k=%d%s", spec.method, spec.num_speculative_tokens,
             "" if spec.adaptive else " (fixed)")
    return SpecDecoder(spec, drafter, entry.kind)
