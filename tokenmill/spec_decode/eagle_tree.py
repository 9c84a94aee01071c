"""EAGLE-2 dynamic draft trees (Li et al. 2024) from a draft head (EAGLE, EAGLE-3, MTP): the head grows a tree
level by level from the root (the request's last token), keeping the `width` nodes of each level with the highest
cumulative draft log-probability (the sum over their path), each expanded into its `width` most likely children;
the tree sent for verification is the `budget` best nodes of everything drafted (a node always scores at most its
parent, so the best nodes include every ancestor of each: a tree).

Every level is one forward of the head over all nodes fed so far (level d: width x d rows per request, the same
shape for every request, so the batch is rectangular), with a tree attention mask so each node sees the context,
its ancestors and itself, as the target does when it verifies (spec_decode/tree.py). Feeding the earlier levels
again costs a few rows of a one-layer head, and keeps the backends' one tree-mask form (the step's own keys);
node m's draft K/V is written at slot c + m past the context, at rotary position c + depth - 1, and overwritten by
the next step's catch-up over the accepted path, as a chain's drafts are.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.spec_decode.tree import ancestors


@dataclass
class TreeShape:
    width: int  # children per expanded node, and nodes expanded per level
    depth: int  # levels at most

    def levels(self, budget: int) -> int:
        """Levels drafted for a tree of `budget` nodes: the nodes fed ((levels - 1) x width) stay within it."""
        return min(self.depth, 1 + (budget - 1) // self.width)

    def fed(self, budget: int) -> int:
        """Draft positions written (slots needed past the context) for a tree of `budget` nodes."""
        return (self.levels(budget) - 1) * self.width


@dataclass
class _Pool:
    """Every request's drafted nodes, as [R, P] arrays in drafting order (parents before children)."""

    tokens: np.ndarray
    parents: np.ndarray  # pool index of each node's parent (-1: the root)
    scores: np.ndarray  # cumulative draft log-probability
    depth: np.ndarray  # 1 for the root's children

    def add(self, tokens: np.ndarray, parents: np.ndarray, scores: np.ndarray, depth: int) -> np.ndarray:
        """Append nodes [R, n]; returns their pool indices [n]."""
        first = self.tokens.shape[1]
        self.tokens = np.concatenate([self.tokens, tokens], 1)
        self.parents = np.concatenate([self.parents, parents], 1)
        self.scores = np.concatenate([self.scores, scores], 1)
        self.depth = np.concatenate([self.depth, np.full(tokens.shape, depth, np.int64)], 1)
        return np.arange(first, first + tokens.shape[1])


def _top(logits: torch.Tensor, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's `width` most likely tokens and their log-probabilities."""
    lp, tok = torch.log_softmax(logits.float(), dim=-1).topk(width, dim=-1)
    return tok.cpu().numpy(), lp.cpu().numpy()


def grow_trees(forward, root_logits: torch.Tensor, root_feat: torch.Tensor | None, shape: TreeShape,
               budget: int) -> list[tuple[list[int], list[int]]]:
    """Trees for R requests: root_logits [R, V] the head's logits for the first draft, root_feat [R, H] the
    feature fed with it (None: the head needs none); forward(ids [R, N], depth [R, N], masks [R, N, N],
    features [R, N, H] or None) -> (output features [R, N, H] or None, logits [R * width, V] of each request's
    last `width` rows) runs one level.
    Returns per request (tokens, parents) of its best `budget` nodes, parents first."""
    w, levels = shape.width, shape.levels(budget)
    R = root_logits.shape[0]
    tok, lp = _top(root_logits, w)
    pool = _Pool(np.zeros((R, 0), np.int64), np.zeros((R, 0), np.int64), np.zeros((R, 0)), np.zeros((R, 0), np.int64))
    frontier = pool.add(tok, np.full((R, w), -1), lp, 1)  # pool indices of the nodes fed next, [w]
    fed_ids = np.zeros(0, np.int64)  # pool indices fed so far (the same columns for every request)
    in_feat = None  # [R, N, H] the feature fed with each fed node (its parent's output)
    parent_feat = root_feat.unsqueeze(1).expand(R, w, -1) if root_feat is not None else None
    rows = np.arange(R)[:, None]
    for level in range(1, levels):
        fed_ids = np.concatenate([fed_ids, frontier])
        if parent_feat is not None:
            in_feat = parent_feat if in_feat is None else torch.cat([in_feat, parent_feat], 1)
        # each fed node's parent as an index into the fed list (-1: the root), per request
        pool_parents = pool.parents[:, fed_ids]
        pos_of = np.full((R, pool.tokens.shape[1]), -1, np.int64)
        pos_of[:, fed_ids] = np.arange(len(fed_ids))
        fed_parents = np.where(pool_parents >= 0, pos_of[rows, np.maximum(pool_parents, 0)], -1)
        masks = np.stack([ancestors(p.tolist()) for p in fed_parents])
        out_feat, logits = forward(pool.tokens[:, fed_ids], pool.depth[:, fed_ids], masks, in_feat)
        tok, lp = _top(logits.reshape(R * w, -1), w)  # children of each frontier node: [R * w, w]
        tok, lp = tok.reshape(R, w * w), lp.reshape(R, w, w)
        scores = (pool.scores[:, frontier][:, :, None] + lp).reshape(R, w * w)
        parents = np.repeat(frontier, w)[None, :].repeat(R, 0)
        children = pool.add(tok, parents, scores, level + 1)
        if level + 1 == levels:
            break
        # the next level: each request's `w` best children (their pool columns differ per request, so the
        # pool is reordered to put them first: frontier columns must be the same for the batch)
        best = np.argsort(-scores, axis=1, kind="stable")[:, :w]  # [R, w] among the w * w children
        order = np.stack([np.concatenate([b, np.setdiff1d(np.arange(w * w), b)]) for b in best])
        for a in (pool.tokens, pool.parents, pool.scores):  # in place
            a[:, children] = a[:, children][rows, order]
        frontier = children[:w]
        if out_feat is not None:  # each new frontier node's parent is one of the last level's w fed nodes
            parent_feat = out_feat[:, -w:][torch.from_numpy(rows), torch.from_numpy(best // w)]
    return [_best(pool, r, budget) for r in range(R)]


def _best(pool: _Pool, r: int, budget: int) -> tuple[list[int], list[int]]:
    """Request r's `budget` best nodes (score, then shallower, then earlier), ordered by level."""
    scores, depth = pool.scores[r], pool.depth[r]
    n = len(scores)
    keep = np.lexsort((np.arange(n), depth, -scores))[:budget]
    keep = keep[np.lexsort((keep, depth[keep]))]  # parents before children
    index = {int(m): j for j, m in enumerate(keep)}
    parents = [index[int(pool.parents[r, m])] if pool.parents[r, m] >= 0 else -1 for m in keep]
    return pool.tokens[r, keep].tolist(), parents
