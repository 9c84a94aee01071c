"""Exact rejection sampling for speculative decoding, vectorised over every row of a batch.

Draft d_j ~ q_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection
the token is drawn from normalize(max(0, p_j - q_j)), and if all k drafts pass a bonus token is
drawn from p_k. Then each emitted token is distributed exactly as p (Leviathan et al. 2023). A
point-mass draft (n-gram, greedy draft) has q_j = one_hot(d_j). Greedy requests compare argmaxes.
"""
from __future__ import annotations

import torch
from torch import Tensor

from tokenmill.sample.draws import ACCEPT_STREAM, SAMPLE_STREAM, inverse_cdf, row_uniforms


def rejection_sample(
    probs: Tensor,
    greedy_tokens: Tensor,
    rows_per_request: list[int],
    draft_token_ids: list[list[int]],
    draft_probs: list[Tensor | None],
    is_greedy: list[bool],
    seeds: Tensor | None,
    all_seeded: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """(token per row [S] int64, number of accepted drafts per request [R] int64), both on probs' device (the
    runner copies them to the host with the step's other results, in one copy).

    Request r owns rows_per_request[r] = k_r + 1 consecutive rows of probs [S, V]: rows before
    num_accepted hold its drafts, row num_accepted the corrected or bonus token, later rows are
    unspecified. draft_probs[r] is [k_r, V] (what the drafts were sampled from) or None (point mass).
    seeds is the sampler's per-row draw keys ([S] int64, -1 unseeded; None: none seeded): a seeded request's
    accept tests and corrected tokens are functions of its seed and output positions alone, not of the batch.
    all_seeded: whether every row is seeded, when known on the host (draws.row_uniforms).
    """
    S, V = probs.shape
    device = probs.device
    starts = [0]
    for n, d in zip(rows_per_request, draft_token_ids):
        assert n == len(d) + 1, "each request owns k + 1 rows for its k drafts"
        starts.append(starts[-1] + n)
    assert starts[-1] == S

    rows = torch.tensor(rows_per_request, dtype=torch.int64, device=device)
    req = torch.repeat_interleave(torch.arange(len(rows_per_request), device=device), rows, output_size=S)
    k = rows - 1
    pos = torch.arange(S, device=device) - (torch.cumsum(rows, 0) - rows)[req]
    is_draft = pos < k[req]
    # The bonus row's "draft" is a placeholder (never accepted: it is not a draft row).
    drafts = torch.tensor([t for d in draft_token_ids for t in (*d, 0)], dtype=torch.int64, device=device)
    greedy_row = torch.tensor(is_greedy, dtype=torch.bool, device=device)[req]

    accept = greedy_tokens == drafts
    final = greedy_tokens
    if not all(is_greedy):
        # Dense q per row: one-hot for point-mass drafts, the draft's distribution where given,
        # zero on bonus rows so that their residual is p itself.
        q = torch.zeros(S, V, dtype=torch.float32, device=device)
        q.scatter_(1, drafts.unsqueeze(1), is_draft.float().unsqueeze(1))
        dense = [(starts[r], qr) for r, qr in enumerate(draft_probs) if qr is not None and len(qr)]
        if dense:
            index = torch.tensor([s + j for s, qr in dense for j in range(len(qr))], device=device)
            q[index] = torch.cat([qr.float() for _, qr in dense]).to(device)
        p_d = probs.gather(1, drafts.unsqueeze(1)).squeeze(1)
        q_d = q.gather(1, drafts.unsqueeze(1)).squeeze(1)
        u = row_uniforms(seeds, S, ACCEPT_STREAM, device, all_seeded)
        accept = torch.where(greedy_row, accept, _accept(u, p_d, q_d))
        sampled = inverse_cdf(_residual(probs, q), row_uniforms(seeds, S, SAMPLE_STREAM, device, all_seeded))
        final = torch.where(greedy_row, greedy_tokens, sampled)

    first_rejected = torch.where(is_draft & ~accept, pos, k[req])
    num_accepted = k.scatter_reduce(0, req, first_rejected, reduce="amin", include_self=True)
    tokens = torch.where(pos < num_accepted[req], drafts, final)
    return tokens, num_accepted


def _accept(u: Tensor, p_d: Tensor, q_d: Tensor) -> Tensor:
    """u < p/q without dividing: q = 0 accepts iff p > 0, p = 0 always rejects."""
    return u * q_d < p_d


def _residual(probs: Tensor, q: Tensor) -> Tensor:
    """max(0, p - q), unnormalised (inverse_cdf does not need it); p where that is all zero."""
    residual = (probs - q).clamp_(min=0)
    return torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, probs)
