"""Tree verification (sample/tree_sampler.py): the greedy walk follows the target's argmax through the tree; with
sampling and point-mass drafts every emitted token is distributed as the target's row that scored it (chi-square,
as tests/sample/test_rejection_sampler.py does for chains: N requests with the same tree in one call); seeded requests
draw the same alone and in a batch; a chain verified as a tree gives what the chain verifier gives (greedy)."""
from __future__ import annotations

import pytest
import torch

from test_rejection_sampler import chi2_pvalue, random_dist, rejection_sample, top_p_target
from tokenmill.sample.draws import position_seed
from tokenmill.sample.tree_sampler import TreeDraft, verify_trees
from tokenmill.spec_decode.tree import ancestors, choices_to_tree, visibility

N = 20000
# root -> nodes 0, 1, 2 (tokens 0, 1, 2); node 0 -> node 3 (token 3); node 1 -> node 4 (token 4);
# node 3 -> node 5 (token 5)
TOKENS = [0, 1, 2, 3, 4, 5]
PARENTS = [-1, -1, -1, 0, 1, 3]


def test_tree_helpers():
    a = ancestors(PARENTS)
    assert a[5].nonzero()[0].tolist() == [0, 3, 5] and a[2].nonzero()[0].tolist() == [2]
    v = visibility(PARENTS)
    assert v[0].nonzero()[0].tolist() == [0] and v[6].nonzero()[0].tolist() == [0, 1, 4, 6]
    assert choices_to_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0]]) == [-1, -1, 0, 1, 2]
    with pytest.raises(ValueError, match="before its parent"):
        choices_to_tree([[0, 0], [0]])


def test_greedy_walk_follows_the_argmax():
    n = len(TOKENS)
    greedy = torch.tensor([1, 9, 4, 9, 9, 9, 9])  # root picks node 1 (token 1); node 1's row (2) picks token 4
    tokens, rows = verify_trees(None, greedy, [TreeDraft(0, TOKENS, PARENTS)], [True], None)
    # node 1 at row 2, node 4 at row 5 (a leaf): emitted 1, 4 and the bonus 9 from row 5
    assert rows == [[0, 2, 5]] and tokens[[0, 2, 5]].tolist() == [1, 4, 9]
    miss = torch.tensor([7] + [9] * n)
    tokens, rows = verify_trees(None, miss, [TreeDraft(0, TOKENS, PARENTS)], [True], None)
    assert rows == [[0]] and tokens[0].item() == 7


@pytest.mark.parametrize("target", ["random", "top_p"])
def test_sampled_tokens_follow_the_row_that_scored_them(target):
    g = torch.Generator().manual_seed(11)
    V, n = 7, len(TOKENS)
    p = random_dist(n + 1, V, g) if target == "random" else top_p_target(n + 1, V, g)
    torch.manual_seed(5)
    trees = [TreeDraft(i * (n + 1), TOKENS, PARENTS) for i in range(N)]
    probs = p.repeat(N, 1)
    tokens, rows = verify_trees(probs, probs.argmax(-1), trees, [False] * N, None)
    tokens = tokens.view(N, n + 1)
    emitted = [[tokens[i, r - i * (n + 1)].item() for r in rs] for i, rs in enumerate(rows)]
    local = [[r - i * (n + 1) for r in rs] for i, rs in enumerate(rows)]
    checks = [(torch.tensor([e[0] for e in emitted]), p[0])]  # the first token: the root row's distribution
    for node in (0, 1, 3):  # a request that reached node m emits, from m's row, a token distributed as that row
        row = node + 1
        after = torch.tensor([e[lr.index(row)] for e, lr in zip(emitted, local) if row in lr])
        support = p[row][p[row] > 0]
        if len(after) * support.min() >= 5:  # enough requests got there for a chi-square test
            checks.append((after, p[row]))
    assert len(checks) >= 2
    for t, dist in checks:
        assert chi2_pvalue(t, dist) > 0.01


def test_seeded_requests_draw_the_same_alone_and_in_a_batch():
    g = torch.Generator().manual_seed(3)
    V, n = 7, len(TOKENS)
    p = random_dist(n + 1, V, g)
    keys = torch.tensor([position_seed(42, j) for j in range(n + 1)])
    alone_tokens, alone_rows = verify_trees(p, p.argmax(-1), [TreeDraft(0, TOKENS, PARENTS)], [False], keys)
    other = random_dist(n + 1, V, g)
    both = torch.cat([other, p])
    both_keys = torch.cat([torch.full((n + 1,), -1), keys])
    tokens, rows = verify_trees(both, both.argmax(-1), [TreeDraft(0, TOKENS, PARENTS), TreeDraft(n + 1, TOKENS, PARENTS)],
                                [False, False], both_keys)
    assert [r - (n + 1) for r in rows[1]] == alone_rows[0]
    assert tokens[rows[1]].tolist() == alone_tokens[alone_rows[0]].tolist()


def test_a_chain_verified_as_a_tree_matches_the_chain_verifier():
    g = torch.Generator().manual_seed(9)
    V, k, R = 11, 4, 64
    logits = torch.randn(R * (k + 1), V, generator=g)
    greedy = logits.argmax(-1)
    drafts = [[int(greedy[r * (k + 1) + j]) if (r + j) % 3 else (int(greedy[r * (k + 1) + j]) + 1) % V
               for j in range(k)] for r in range(R)]
    want, accepted = rejection_sample(logits, greedy, [k + 1] * R, drafts, [None] * R, [True] * R, None)
    trees = [TreeDraft(r * (k + 1), d, [-1, 0, 1, 2]) for r, d in enumerate(drafts)]
    tokens, rows = verify_trees(None, greedy, trees, [True] * R, None)
    for r in range(R):
        assert rows[r] == list(range(r * (k + 1), r * (k + 1) + accepted[r] + 1))
        assert tokens[rows[r]].tolist() == want[rows[r]].tolist()
