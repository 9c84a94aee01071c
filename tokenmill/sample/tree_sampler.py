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


@dataclass
class TreeWalk:
    """The host's view of a verification's nodes, to read the accepted paths off the on-path mask once it has
    come back with the step's other results (one copy, SamplerOutput.to_host)."""

    trees: list[TreeDraft]
    first: np.ndarray  # each request's first node in the flat order
    row: np.ndarray  # each node's own row

    def emit_rows(self, on_path: np.ndarray) -> list[list[int]]:
        """Per request: the rows that scored the tokens it emits, in order (its path's nodes in node order are in
        depth order: parents come first)."""
        out = []
        for r, t in enumerate(self.trees):
            nodes = self.first[r] + np.flatnonzero(on_path[self.first[r] : self.first[r] + len(t.tokens)])
            out.append([t.root_row] + self.row[nodes].tolist())
        return out


def verify_trees(probs: Tensor | None, greedy_ids: Tensor, trees: list[TreeDraft], is_greedy: list[bool],
                 seeds: Tensor | None) -> tuple[Tensor, list[list[int]]]:
    """(a token per sampled row [S], the rows whose tokens each request emits, in order): verify_on_device with
    the path read back at once (the runner reads it with the step's results instead)."""
    row_tokens, on_path, walk = verify_on_device(probs, greedy_ids, trees, is_greedy, seeds)
    return row_tokens, walk.emit_rows(on_path.cpu().numpy())


def verify_on_device(probs: Tensor | None, greedy_ids: Tensor, trees: list[TreeDraft], is_greedy: list[bool],
                     seeds: Tensor | None) -> tuple[Tensor, Tensor, TreeWalk]:
    """(a token per sampled row [S], whether each node is on its request's accepted path [M] bool, the walk that
    reads the paths on the host), all computed on the device without reading anything back.

    probs [S, V]: the target's distribution per row (None when every request is greedy); greedy_ids [S]. A request
    emits the tokens of its accepted path and one more; row_tokens holds each emitted token at the row that scored
    it (other rows: the greedy token), so logprobs come from the right rows."""
    S = greedy_ids.shape[0]
    device = greedy_ids.device
    sizes = [len(t.tokens) for t in trees]
    M, R = sum(sizes), len(trees)
    greedy_req = torch.tensor(is_greedy, dtype=torch.bool, device=device)
    # Every node, flattened: its request, token, own row, parent's row and node, rank among its siblings, depth.
    req = np.repeat(np.arange(R), sizes)
    tokens = np.fromiter((x for t in trees for x in t.tokens), np.int64, M)
    parent_local = np.fromiter((p for t in trees for p in t.parents), np.int64, M)
    root_rows = np.fromiter((t.root_row for t in trees), np.int64, R)
    root = root_rows[req]
    first = np.cumsum(sizes) - sizes  # each request's first node
    local = np.arange(M) - first[req]
    row = root + 1 + local
    parent_row = np.where(parent_local >= 0, root + 1 + parent_local, root)
    parent_node = np.where(parent_local >= 0, first[req] + parent_local, -1)  # global index, -1: the root
    depth = np.ones(M, dtype=np.int64)
    while True:  # one pass per level (a small constant); host bookkeeping over the drafted nodes
        deeper = np.where(parent_node >= 0, depth[np.maximum(parent_node, 0)] + 1, 1)
        if (deeper == depth).all():
            break
        depth = deeper
    order = np.lexsort((np.arange(M), parent_row))  # sibling groups together, each in node order
    key = parent_row[order]
    starts = np.r_[0, np.flatnonzero(key[1:] != key[:-1]) + 1]
    group_start = np.repeat(starts, np.diff(np.r_[starts, M]))  # per sorted position: its group's first
    rank = np.empty(M, dtype=np.int64)
    rank[order] = np.arange(M) - group_start

    # One upload of the node arrays (rows, tokens, order, groups, requests, parents, ranks).
    ints = torch.from_numpy(np.concatenate([tokens, parent_row, order, group_start, req, np.maximum(parent_node, 0),
                                            rank, row])).to(device)
    t_tokens, t_parent_row, t_order, t_group_start, t_req, t_parent, t_rank, t_row = ints.split(M)
    greedy_node = greedy_req[t_req]
    ok = greedy_ids[t_parent_row] == t_tokens  # greedy: the argmax at the parent's row
    if probs is not None and not all(is_greedy):
        p = probs[t_parent_row, t_tokens].double()  # p(t_m) at its parent's row
        sorted_p = p[t_order]
        excl = torch.cumsum(sorted_p, 0) - sorted_p
        before = torch.empty_like(p)
        before[t_order] = excl - excl[t_group_start]  # p of the earlier siblings
        left = (1.0 - before).clamp_min(0.0)
        u = _child_uniforms(seeds, t_parent_row, t_rank, np.unique(rank).tolist(), S, device)
        ok = torch.where(greedy_node, ok, u * left < p)  # u < p / left, without dividing
    # The first accepted child of each parent; a node is on the path iff it and all its ancestors are.
    ok_sorted = ok[t_order].long()
    hits = torch.cumsum(ok_sorted, 0)
    hits = hits - (hits - ok_sorted)[t_group_start]  # accepted siblings up to and including this one
    chosen = torch.empty_like(ok)
    chosen[t_order] = (ok_sorted == 1) & (hits == 1)
    is_top = torch.from_numpy(parent_node < 0).to(device)
    on_path = chosen & is_top
    for _ in range(int(depth.max(initial=1)) - 1):  # one level deeper per pass (the depth is the host's)
        on_path = chosen & (is_top | on_path[t_parent])
    # Each request's deepest accepted node (node order puts parents first: the largest index on its path), the row
    # that scores the token after its path, and each path row's token (the on-path child it scored; one at most).
    node_ids = torch.arange(M, device=device)
    last = torch.full((R,), -1, dtype=torch.long, device=device).scatter_reduce(
        0, t_req, torch.where(on_path, node_ids, -1), reduce="amax")
    final_rows = torch.where(last >= 0, t_row[last.clamp_min(0)], torch.from_numpy(root_rows).to(device))
    child_token = torch.full((S,), -1, dtype=torch.long, device=device).scatter_reduce(
        0, t_parent_row, torch.where(on_path, t_tokens, -1), reduce="amax")
    row_tokens = torch.where(child_token >= 0, child_token, greedy_ids)
    final = greedy_ids[final_rows]
    if probs is not None and not all(is_greedy):
        # The final row's distribution without the tokens of the last node's children (all rejected; none at a
        # leaf, where the bonus token comes from p itself).
        residual = probs[final_rows].double().clone()
        last_of_node = last[t_req]
        kid = torch.where(is_top, last_of_node < 0, t_parent == last_of_node)  # children of the last accepted node
        # (Nodes of one request may share a token on different levels: a count per (request, token), not a write.)
        rejected = torch.zeros(residual.shape, dtype=torch.int32, device=device).index_put_(
            (t_req, t_tokens), kid.int(), accumulate=True)
        residual = residual.masked_fill(rejected > 0, 0.0)
        empty = residual.sum(-1) <= 0  # only by rounding: every token with mass was a rejected child
        residual = torch.where(empty.unsqueeze(1), probs[final_rows].double(), residual)
        keys = seeds[final_rows] if seeds is not None else None
        drawn = inverse_cdf(residual, row_uniforms(keys, R, SAMPLE_STREAM, device))
        final = torch.where(greedy_req, final, drawn)
    row_tokens = row_tokens.index_copy(0, final_rows, final)
    return row_tokens, on_path, TreeWalk(trees, first, row)


def _child_uniforms(seeds: Tensor | None, parent_row: Tensor, rank: Tensor, ranks: list[int], S: int,
                    device) -> Tensor:
    """U[0, 1) for trying child `rank` of `parent_row`: stream CHILD_STREAM + rank of the row's key (`ranks`: the
    distinct ranks, from the host)."""
    out = torch.empty(parent_row.shape[0], dtype=torch.float64, device=device)
    for j in ranks:
        u = row_uniforms(seeds, S, CHILD_STREAM + j, device)
        out = torch.where(rank == j, u[parent_row], out)
    return out
