"""Verification of draft trees (speculative decoding with Medusa trees, issue 30), vectorised over every node of
every request in the step.

A request's draft is a tree: node m has a token and a parent (-1: the request's last token, the root); parents
come before their children and siblings carry distinct tokens. The target scored the root and every node in one
forward (a tree attention mask: each node sees the context, its ancestors and itself), so row root + 1 + m holds
the target's distribution after the path to node m.

Acceptance walks down from the root. Greedy: the child whose token is the target's argmax at its parent's row.
Sampling, with point-mass drafts (each node's token proposed deterministically): the children of a node are
tried in order, child j accepted with probability p'(t_j) where p' is the parent row's distribution with the
earlier siblings' tokens removed and renormalised, p'(t_j) = p(t_j) / (1 - sum_{i<j} p(t_i)) (the recursive
rejection rule of SpecInfer for deterministic drafts); an accepted child continues the walk; if every child is
rejected, the token is drawn from p with all the children's tokens removed, and at a leaf from p itself. Every
emitted token is then distributed exactly as the target's sampler would draw it. Each try has its own uniform
(stream 2 + j of the parent row's key; seeded rows are reproducible), so all tries are computed at once and the
walk is read off: node m is on the path iff it and each ancestor are the first accepted child of their parent.
A chain is the tree with parents [-1, 0, 1, ...] (the chain verifier, rejection_sampler.py, stays its fast path).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from tokenmill.sample.draws import SAMPLE_STREAM, inverse_cdf, row_uniforms

CHILD_STREAM = 2  # child j of a row is tried with the row's uniform of stream CHILD_STREAM + j


@dataclass
class TreeDraft:
    """One request's tree as verification sees it."""

    root_row: int  # the packed sampled row of the request's last token
    tokens: list[int]
    parents: list[int]  # -1: a child of the root


def verify_trees(probs: Tensor | None, greedy_ids: Tensor, trees: list[TreeDraft], is_greedy: list[bool],
                 seeds: Tensor | None) -> tuple[Tensor, list[list[int]]]:
    """(a token per sampled row [S], the rows whose tokens each request emits, in order).

    probs [S, V]: the target's distribution per row (None when every request is greedy); greedy_ids [S]. A request
    emits the tokens of its accepted path and one more; row_tokens holds each emitted token at the row that scored
    it (other rows: the greedy token), so logprobs come from the right rows."""
    S = greedy_ids.shape[0]
    device = greedy_ids.device
    sizes = [len(t.tokens) for t in trees]
    M = sum(sizes)
    row_tokens = greedy_ids.clone()
    greedy_req = torch.tensor(is_greedy, dtype=torch.bool, device=device)
    # Every node, flattened: its request, token, own row, parent's row and node, rank among its siblings.
    req = np.repeat(np.arange(len(trees)), sizes)
    tokens = np.fromiter((x for t in trees for x in t.tokens), np.int64, M)
    parent_local = np.fromiter((p for t in trees for p in t.parents), np.int64, M)
    root = np.fromiter((t.root_row for t in trees), np.int64, len(trees))[req]
    first = np.cumsum(sizes) - sizes  # each request's first node
    local = np.arange(M) - first[req]
    row = root + 1 + local
    parent_row = np.where(parent_local >= 0, root + 1 + parent_local, root)
    parent_node = np.where(parent_local >= 0, first[req] + parent_local, -1)  # global index, -1: the root
    order = np.lexsort((np.arange(M), parent_row))  # sibling groups together, each in node order
    key = parent_row[order]
    starts = np.r_[0, np.flatnonzero(key[1:] != key[:-1]) + 1]
    group_start = np.repeat(starts, np.diff(np.r_[starts, M]))  # per sorted position: its group's first
    rank = np.empty(M, dtype=np.int64)
    rank[order] = np.arange(M) - group_start

    t_tokens = torch.from_numpy(tokens).to(device)
    t_parent_row = torch.from_numpy(parent_row).to(device)
    t_order = torch.from_numpy(order).to(device)
    t_group_start = torch.from_numpy(group_start).to(device)
    greedy_node = greedy_req[torch.from_numpy(req).to(device)]
    ok = greedy_ids[t_parent_row] == t_tokens  # greedy: the argmax at the parent's row
    if probs is not None and not all(is_greedy):
        p = probs[t_parent_row, t_tokens].double()  # p(t_m) at its parent's row
        sorted_p = p[t_order]
        excl = torch.cumsum(sorted_p, 0) - sorted_p
        before = torch.empty_like(p)
        before[t_order] = excl - excl[t_group_start]  # p of the earlier siblings
        left = (1.0 - before).clamp_min(0.0)
        u = _child_uniforms(seeds, t_parent_row, torch.from_numpy(rank).to(device), S, device)
        ok = torch.where(greedy_node, ok, u * left < p)  # u < p / left, without dividing
    # The first accepted child of each parent; a node is on the path iff it and all its ancestors are.
    ok_sorted = ok[t_order].long()
    hits = torch.cumsum(ok_sorted, 0)
    hits = hits - (hits - ok_sorted)[t_group_start]  # accepted siblings up to and including this one
    chosen = torch.empty_like(ok)
    chosen[t_order] = (ok_sorted == 1) & (hits == 1)
    chosen_np = chosen.cpu().numpy()
    on_path = chosen_np.copy()
    has_parent = parent_node >= 0
    while True:  # once per tree level (a small constant)
        nxt = chosen_np & (~has_parent | on_path[np.maximum(parent_node, 0)])
        if (nxt == on_path).all():
            break
        on_path = nxt
    # Per request: the path in depth order (node order: parents first), the rows that scored its tokens.
    emit_rows: list[list[int]] = []
    last = np.full(len(trees), -1, dtype=np.int64)  # each request's deepest accepted node (-1: the root)
    for r, t in enumerate(trees):
        nodes = first[r] + np.flatnonzero(on_path[first[r]: first[r] + sizes[r]])
        rows = [t.root_row] + row[nodes].tolist()
        emit_rows.append(rows)
        if nodes.size:
            row_tokens[torch.as_tensor(rows[:-1], device=device)] = torch.as_tensor(tokens[nodes], device=device)
            last[r] = nodes[-1]
    final_rows = torch.tensor([rows[-1] for rows in emit_rows], dtype=torch.long, device=device)
    final = greedy_ids[final_rows]
    if probs is not None and not all(is_greedy):
        # The final row's distribution without the tokens of the last node's children (all rejected; none at a
        # leaf, where the bonus token comes from p itself).
        residual = probs[final_rows].double().clone()
        kids = np.flatnonzero(parent_node == last[req])
        if kids.size:
            residual[torch.from_numpy(req[kids]).to(device), torch.from_numpy(tokens[kids]).to(device)] = 0.0
        empty = residual.sum(-1) <= 0  # only by rounding: every token with mass was a rejected child
        residual = torch.where(empty.unsqueeze(1), probs[final_rows].double(), residual)
        keys = seeds[final_rows] if seeds is not None else None
        drawn = inverse_cdf(residual, row_uniforms(keys, len(trees), SAMPLE_STREAM, device))
        final = torch.where(greedy_req, final, drawn)
    row_tokens[final_rows] = final
    return row_tokens, emit_rows


def _child_uniforms(seeds: Tensor | None, parent_row: Tensor, rank: Tensor, S: int, device) -> Tensor:
    """U[0, 1) for trying child `rank` of `parent_row`: stream CHILD_STREAM + rank of the row's key."""
    out = torch.empty(parent_row.shape[0], dtype=torch.float64, device=device)
    for j in torch.unique(rank).tolist():
        sel = rank == j
        u = row_uniforms(seeds, S, CHILD_STREAM + j, device)
        out[sel] = u[parent_row[sel]]
    return out
