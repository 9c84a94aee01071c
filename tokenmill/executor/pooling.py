"""The model runner's pooling stage: an embedding request (SamplingParams.pooling) samples nothing; the step that
computes the end of its prompt returns its pooled final hidden state (after the final norm). Mixed into ModelRunner.

"last" takes the last prompt position's hidden state. "mean" averages every prompt position's: a long prompt runs
in several chunks (chunked prefill), so each chunk's rows are summed into the request's worker state and the sum is
divided by the prompt's length at its last chunk. A mean-pooled request reads no prefix-cache hit
(core/request.py, `reads_prefix_cache`: a cached block holds K/V, not hidden states), so every position is computed
here; a sum that does not hold them all (the worker lost its copy of the request mid-prompt) fails the request
instead of returning a wrong vector.

A step without embedding requests costs one set lookup here; the generating requests' rows are never touched.
"""
from __future__ import annotations

import numpy as np
import torch

from tokenmill.executor.input_batch import InputBatch, StepInputs, _ranks


class Pooling:
    """Mixed into ModelRunner; reads its input batch (the held embedding requests, their partial sums)."""

    input_batch: InputBatch

    def _pool(self, hidden: torch.Tensor, inp: StepInputs) -> dict[str, list[float]]:
        """The pooled vectors of the step's embedding requests whose prompt ends in it, by id (float32 values);
        mean-pooled ones whose prompt goes on add this chunk to their sums."""
        if not self.input_batch.pooling:  # the usual step: no embedding request held
            return {}
        which = [i for i, r in enumerate(inp.requests) if r.params.pooling is not None]
        if not which:
            return {}
        reqs = [inp.requests[i] for i in which]
        idx = np.asarray(which, dtype=np.int64)
        start = inp.layout.query_start.numpy()[idx]  # each one's first row of the packed batch, and its rows
        n = inp.layout.query_len.numpy()[idx]
        upload = self.input_batch.uploader.upload
        mean = [j for j, r in enumerate(reqs) if r.params.pooling.pooling == "mean"]
        if mean:  # this chunk's rows summed per request, in one gather and one index_add
            m = np.asarray(mean, dtype=np.int64)
            counts = n[m]
            rows = np.repeat(start[m], counts) + _ranks(counts)
            segment = np.repeat(np.arange(len(mean)), counts)
            sums = torch.zeros(len(mean), hidden.shape[-1], dtype=torch.float32, device=hidden.device)
            sums.index_add_(0, upload(segment), hidden.index_select(0, upload(rows)).float())
            for k, j in enumerate(mean):
                r = reqs[j]
                r.pool_sum = sums[k] if r.pool_sum is None else r.pool_sum + sums[k]
                r.pool_count += int(counts[k])
        done = [j for j, r in enumerate(reqs) if r.num_computed_tokens + int(n[j]) >= r.num_prompt_tokens]
        if not done:
            return {}
        vectors: dict[int, torch.Tensor] = {}
        last = [j for j in done if reqs[j].params.pooling.pooling != "mean"]
        if last:
            rows = start[last] + n[last] - 1
            for j, v in zip(last, hidden.index_select(0, upload(rows)).float()):
                vectors[j] = v
        for j in done:
            r = reqs[j]
            if j in vectors:
                continue
            if r.pool_count != r.num_prompt_tokens:
                raise RuntimeError(f"request {r.req_id}: its mean pools {r.pool_count} of its {r.num_prompt_tokens} "
                                   "prompt positions (the worker lost its partial sum); it cannot be pooled")
            vectors[j] = r.pool_sum / r.pool_count
        host = torch.stack([vectors[j] for j in done]).cpu()  # the step's one copy of its vectors to the host
        return {reqs[j].req_id: row for j, row in zip(done, host.tolist())}
