"""Draft trees (issue 30): a draft is a list of nodes, each a token and the index of its parent (-1: a child of
the request's last token, the root), parents before children, siblings with distinct tokens. A chain of k drafts
is the tree with parents [-1, 0, ..., k-2].

The target verifies a tree in one forward over the root and every node: node m's query sits at KV slot
c + 1 + m (c: the root's position) but at rotary position c + depth(m), and sees the context, its ancestors and
itself (`visibility`); after verification the accepted path's K/V moves to slots c + 1 .. c + a (the runner's
compaction), as if the path had been a chain.
"""
from __future__ import annotations

import numpy as np


def ancestors(parents: list[int]) -> np.ndarray:
    """[n, n] bool: a[m, j] = node j is node m or one of its ancestors."""
    n = len(parents)
    a = np.zeros((n, n), dtype=bool)
    for m, p in enumerate(parents):
        if not -1 <= p < m:
            raise ValueError(f"draft tree: node {m}'s parent {p} must be -1 or an earlier node")
        if p >= 0:
            a[m] = a[p]
        a[m, m] = True
    return a


def depths(parents: list[int]) -> np.ndarray:
    """Depth of each node: 1 for a child of the root."""
    return ancestors(parents).sum(1)


def is_chain(parents: list[int]) -> bool:
    return all(p == m - 1 for m, p in enumerate(parents))


def visibility(parents: list[int]) -> np.ndarray:
    """[1 + n, 1 + n] bool over the step's new tokens (the root, then the nodes): which each query may see."""
    n = len(parents)
    v = np.zeros((n + 1, n + 1), dtype=bool)
    v[:, 0] = True
    v[1:, 1:] = ancestors(parents)
    return v


def chain(n: int) -> list[int]:
    """The parents of a chain of n drafts."""
    return list(range(-1, n - 1))


def choices_to_tree(choices: list[list[int]]) -> list[int]:
    """Medusa's `medusa_choices` (each node as the path of top-k ranks that leads to it, e.g. [0, 1]: the
    second candidate of head 1 after the first of head 0) -> parents, in the given order (which must list a
    node's parent path before it)."""
    index = {}
    parents = []
    for m, path in enumerate(choices):
        path = tuple(path)
        if not path or path in index:
            raise ValueError(f"medusa_choices: {list(path)} is empty or repeated")
        if len(path) > 1 and path[:-1] not in index:
            raise ValueError(f"medusa_choices: {list(path)} comes before its parent {list(path[:-1])}")
        parents.append(index[path[:-1]] if len(path) > 1 else -1)
        index[path] = m
    return parents


def tree_safe(request, length: int) -> bool:
    """Whether a request's verification rows are scored the same whatever tokens precede them in the tree, so
    any node may be verified (penalties, a grammar and pending min_tokens depend on the tokens before each row:
    such requests get chains). `request`: input_batch.CachedRequestState; `length`: its tokens now."""
    p = request.params
    return (p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and p.structured_outputs is None and length - request.num_prompt_tokens >= p.min_tokens)


def windowed(target) -> bool:
    """Whether a target model has sliding-window layers (their masks count slots, not a node's path: chains)."""
    return any(layer.sliding_window is not None for layer in target.spec.layers)
