"""The model runner's sampling stage: every sampled row of a step sampled, a request's drafts verified by exact
rejection sampling (trees: tree_verify.py), and the accepted tokens and their logprobs cut per request.
Mixed into ModelRunner."""
from __future__ import annotations

import numpy as np
import torch

from tokenmill.core.batch import ModelRunnerOutput, ScheduledBatch
from tokenmill.executor.input_batch import InputBatch, StepInputs
from tokenmill.sample.rejection_sampler import rejection_sample
from tokenmill.sample.sampler import Sampler, SamplerOutput, SamplingMetadata, target_distribution
from tokenmill.testing import faults


class StepSampling:
    """Mixed into ModelRunner; reads its input batch, sampler and speculative decoder."""

    input_batch: InputBatch
    sampler: Sampler
    spec: object | None  # spec_decode.decoder.SpecDecoder

    def _sampling_metadata(self, inp: StepInputs, batch: ScheduledBatch) -> SamplingMetadata:
        """One row per sampled row, gathered from the state the input batch converted at admission: a
        draft row's penalties count the drafts before it as output, and min_tokens bans stop tokens and
        EOS on each row by the output position that row scores."""
        meta = self.input_batch.sampling_metadata(inp)
        if batch.structured_output_rows:
            grammar_rows, bitmask_rows = [], []  # sampled rows under a grammar, and their rows of the bitmask
            row = 0
            for r, rows in zip(inp.requests, inp.rows_per_request):
                first = batch.structured_output_rows.get(r.req_id)
                if first is not None and rows:
                    grammar_rows.extend(range(row, row + rows))
                    bitmask_rows.extend(range(first, first + rows))
                row += rows
            if grammar_rows:
                upload = self.input_batch.uploader.upload
                meta.grammar_rows = upload(np.asarray(grammar_rows, dtype=np.int64))
                meta.grammar_bitmask = upload(batch.grammar_bitmask[np.asarray(bitmask_rows, dtype=np.int64)])
        return meta

    def _sample(self, logits: torch.Tensor, inp: StepInputs, batch: ScheduledBatch) -> ModelRunnerOutput:
        """Sample every sampled row; a request with drafts has its rows verified against them."""
        faults.maybe_raise("sample", (r.req_id for r, n in zip(inp.requests, inp.rows_per_request) if n))
        self.input_batch.reseed(inp)
        meta = self._sampling_metadata(inp, batch)
        if not batch.spec_token_ids:
            return self._result(inp, self.sampler(logits, meta), None)
        # Exact rejection sampling against each draft's q (a point mass for n-gram and greedy drafts).
        raw, greedy_ids, probs = target_distribution(logits, meta)
        if inp.spec_parents:  # some drafts are trees: every request's verified as one (a chain is a tree too)
            return self._verify_trees(inp, raw, greedy_ids, probs, meta)
        reqs = [(r, rows, spec) for r, rows, spec in zip(inp.requests, inp.rows_per_request, inp.spec) if rows]
        draft_probs = [self.spec.probs_for(r.req_id, len(spec)) if self.spec is not None and spec else None
                       for r, _, spec in reqs]
        tokens, num_accepted = rejection_sample(
            probs if probs is not None else raw, greedy_ids, [rows for _, rows, _ in reqs],
            [spec for _, _, spec in reqs], draft_probs, [r.params.greedy for r, _, _ in reqs], meta.seeds,
            meta.all_seeded)
        return self._result(inp, Sampler.output(raw, tokens, meta), num_accepted)

    def _result(self, inp: StepInputs, sampled: SamplerOutput, accepted: torch.Tensor | None) -> ModelRunnerOutput:
        tokens, lp, num_accepted = sampled.to_host(accepted)  # the step's one copy of its results to the host
        return self._emit(inp, tokens, lp, num_accepted)

    def _emit(self, inp: StepInputs, tokens: list[int], lp, num_accepted: list[int] | None,
              emit_rows: list[list[int]] | None = None) -> ModelRunnerOutput:
        """Per request: its sampled rows' tokens, cut after the accepted drafts and the one token that
        follows them (trees: the rows of its accepted path and the one after, `emit_rows`)."""
        result = ModelRunnerOutput()
        row = j = 0
        for r, rows in zip(inp.requests, inp.rows_per_request):
            if not rows:
                continue
            n = num_accepted[j] + 1 if num_accepted is not None else rows
            emitted = emit_rows[j] if emit_rows is not None else range(row, row + n)
            j += 1
            result.req_ids.append(r.req_id)
            result.sampled_token_ids.append([tokens[i] for i in emitted] if emit_rows is not None
                                            else tokens[row : row + n])
            if lp is not None and r.params.logprobs is not None:
                k = r.params.logprobs
                result.logprobs[r.req_id] = [
                    (lp[0][i], lp[1][i], lp[2][i][:k], lp[3][i][:k]) for i in emitted]
            row += rows
        return result
