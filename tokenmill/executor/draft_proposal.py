"""The model runner's draft proposal: after a step, what it cost and what verification accepted go to the
speculative decoder, which drafts every request's next step. Mixed into ModelRunner."""
from __future__ import annotations

import torch

from tokenmill.core.batch import ModelRunnerOutput, ScheduledBatch
from tokenmill.executor.input_batch import InputBatch, StepInputs


class DraftProposal:
    """Mixed into ModelRunner; reads (and clears) `_path_rows`, the tree paths tree_verify.py moved."""

    model: torch.nn.Module
    input_batch: InputBatch
    spec: object | None  # spec_decode.decoder.SpecDecoder
    _path_rows: tuple[torch.Tensor, torch.Tensor] | None

    def _propose(self, inp: StepInputs, batch: ScheduledBatch, hidden: torch.Tensor, out: ModelRunnerOutput,
                 forward_s: float) -> None:
        """Record what the step cost and what verification accepted, then draft the next step."""
        from tokenmill.spec_decode.draft import StepView

        sampled = dict(zip(out.req_ids, out.sampled_token_ids))
        verified = [(len(sp), len(sampled[r.req_id]) - 1) for r, sp in zip(inp.requests, inp.spec)
                    if sp and r.req_id in sampled]
        self.spec.observe(batch.num_tokens, forward_s, verified)
        lay = inp.layout
        aux = self.model.aux_hidden_states  # EAGLE-3 targets set it; None otherwise
        moved, self._path_rows = self._path_rows, None
        if moved is not None:  # accepted tree paths: their hidden rows in chain order too, as their K/V
            src, dst = (self.input_batch.uploader.upload(x) for x in moved)
            hidden = hidden.index_copy(0, dst, hidden.index_select(0, src))
            aux = aux.index_copy(0, dst, aux.index_select(0, src)) if aux is not None else None
        view = StepView(inp.requests, lay.kv_len.numpy() - lay.query_len.numpy(), list(batch.num_scheduled_tokens),
                        lay.query_start.numpy(), [sampled.get(r.req_id) for r in inp.requests], hidden, aux)
        out.spec_token_ids, out.spec_parents = self.spec.propose(view)
