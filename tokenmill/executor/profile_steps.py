"""The dummy steps that measure a step's peak memory before the GPU KV pool is sized (issue 31).

vLLM's recipe runs the largest forward the scheduler may send and gives the pool what is left of
`--gpu-memory-utilization`. The forward is not all a step holds, so the steps here reach for every buffer a real
step can: `max_num_batched_tokens` prompt tokens over `max_num_seqs` requests (every one of them sampled: the
sampler's [rows, vocab] logits, probabilities and sort buffers), each with the most logprobs the server allows
and prompt logprobs over its whole chunk (logits for every prompt row), then, with speculative decoding on, a step
that verifies k drafts for every request (rows x (k + 1) sampled rows, the drafter's own forwards and
probabilities) under a grammar bitmask for every row. Pure Python: the worker runs them.
"""
from __future__ import annotations

import numpy as np

from tokenmill.core.batch import CachedRequestData, NewRequestData, ScheduledBatch
from tokenmill.sampling_params import SamplingParams

MAX_LOGPROBS = 20  # the most (prompt) logprobs a request may ask for (vLLM's default max_logprobs)


def profile_steps(max_tokens: int, max_seqs: int, max_model_len: int, block_size: int, vocab_size: int,
                  num_groups: int = 1, spec_k: int = 0) -> tuple[list[ScheduledBatch], int]:
    """The dummy steps and the KV blocks they use (block ids 0 .. n-1). The last step finishes every request."""
    k = spec_k
    seqs = max(1, min(max_seqs, max_tokens))
    lens = [max_tokens // seqs] * seqs
    lens[0] += max_tokens - sum(lens)
    lens = [max(1, min(n, max_model_len - k - 2)) for n in lens]
    params = SamplingParams(max_tokens=k + 2, temperature=1.0, top_k=50, top_p=0.9, min_p=0.01,
                            logprobs=MAX_LOGPROBS, prompt_logprobs=MAX_LOGPROBS, ignore_eos=True)
    ids = [f"profile-{i}" for i in range(seqs)]
    new, tables, first = [], [], 0
    for rid, n in zip(ids, lens):
        nb = -(-(n + k + 1) // block_size)
        table = list(range(first, first + nb))
        first += nb
        tables.append(table)
        prompt = [(7 * j + 3) % vocab_size for j in range(n)]
        new.append(NewRequestData(rid, prompt, n, table, 0, params, None, group_block_ids=[table] * (num_groups - 1)))
    prefill = ScheduledBatch(ids, list(lens), [1] * seqs, new,
                             prompt_logprob_ranges={rid: (0, n - 1) for rid, n in zip(ids, lens) if n > 1})
    steps = [prefill]
    if k:
        rows = k + 1
        drafts = {rid: [(5 * j + 1) % vocab_size for j in range(k)] for rid in ids}
        # (the token step 1 sampled: its value does not matter to memory)
        cached = [CachedRequestData(rid, [1], [], n, len(t), group_new_block_ids=[[]] * (num_groups - 1))
                  for rid, n, t in zip(ids, lens, tables)]
        words = -(-vocab_size // 32)
        verify = ScheduledBatch(ids, [rows] * seqs, [rows] * seqs, [], cached, spec_token_ids=drafts,
                                structured_output_rows={rid: i * rows for i, rid in enumerate(ids)},
                                grammar_bitmask=np.full((seqs * rows, words), -1, dtype=np.int32))
        steps.append(verify)
    steps.append(ScheduledBatch(finished_req_ids=list(ids)))
    return steps, first
