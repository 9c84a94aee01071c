"""The model runner's prompt logprobs: every prompt-logprob request's rows of a step scored in one LM-head pass
and brought to the host in one copy. Mixed into ModelRunner."""
from __future__ import annotations

import numpy as np
import torch

from tokenmill.core.batch import PromptLogprobs
from tokenmill.executor.input_batch import InputBatch, StepInputs
from tokenmill.sample.sampler import compute_logprobs


class PromptLogprobRows:
    """Mixed into ModelRunner; reads its model (the LM head) and input batch (the uploader)."""

    model: torch.nn.Module
    input_batch: InputBatch

    def _prompt_logprobs(self, hidden: torch.Tensor, inp: StepInputs) -> dict[str, PromptLogprobs]:
        """Every prompt-logprob request's rows in one LM-head pass and one copy to the host (a copy per list
        per request before: four device syncs each)."""
        if not inp.prompt_rows:
            return {}
        logits = self.model.compute_logits(torch.cat([hidden[row : row + n] for _, row, n, _ in inp.prompt_rows]))
        targets = [r.token_ids[pos + 1 : pos + 1 + n] for r, _, n, pos in inp.prompt_rows]
        K = max(max(r.params.prompt_logprobs, 1) for r, _, _, _ in inp.prompt_rows)
        flat = self.input_batch.uploader.upload(np.fromiter((t for ts in targets for t in ts), np.int64,
                                                            logits.shape[0]))
        lp, top_lp, top_ids, ranks = compute_logprobs(logits, flat, K)
        N, K = top_ids.shape
        host = torch.cat([lp.double(), ranks.double(), top_ids.double().reshape(-1),
                          top_lp.double().reshape(-1)]).cpu().numpy()
        lps, rks = host[:N].tolist(), host[N : 2 * N].astype(np.int64).tolist()
        ids = host[2 * N : 2 * N + N * K].astype(np.int64).reshape(N, K)
        tops = host[2 * N + N * K :].reshape(N, K)
        out, at = {}, 0
        for (r, _, n, pos), tgt in zip(inp.prompt_rows, targets):
            k = r.params.prompt_logprobs
            out[r.req_id] = PromptLogprobs(pos, tgt, lps[at : at + n], rks[at : at + n], ids[at : at + n, :k].tolist(),
                                           tops[at : at + n, :k].tolist())
            at += n
        return out
