"""NgramProposer (prompt lookup) against a pure-Python reference."""

import random
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.spec_decode.ngram import NgramProposer


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    if k <= 0:
        return []
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        pattern = tokens[-n:]
        for start in range(length - n - 1, -1, -1):  # the occurrence ends before the last position
            if tokens[start : start + n] == pattern:
                return tokens[start + n : start + n + k]
    return []


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=60),
    k=st.integers(-1, 8),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 3),
    as_numpy=st.booleans(),
)
def test_matches_reference(tokens, k, min_n, extra, as_numpy):
    max_n = min_n + extra
    seq = np.array(tokens, dtype=np.int32) if as_numpy else tokens
    got = NgramProposer(min_n, max_n).propose(seq, k)
    assert got == reference(tokens, k, min_n, max_n)
    assert all(type(t) is int for t in got)


def test_random_longer_sequences():
    rng = random.Random(0)
    for _ in range(100):
        tokens = [rng.randrange(rng.choice([2, 3, 5])) for _ in range(rng.randrange(1, 400))]
        min_n = rng.randrange(1, 4)
        max_n = min_n + rng.randrange(0, 5)
        k = rng.randrange(0, 10)
        assert NgramProposer(min_n, max_n).propose(np.array(tokens), k) == reference(tokens, k, min_n, max_n)


def test_no_match():
    assert NgramProposer(1, 3).propose([1, 2, 3, 4, 5], 4) == []


def test_match_at_very_start():
    assert NgramProposer(2, 2).propose([7, 8, 9, 1, 2, 7, 8], 3) == [9, 1, 2]


def test_most_recent_match_wins():
    assert NgramProposer(2, 2).propose([5, 6, 1, 5, 6, 2, 5, 6, 3, 0, 5, 6], 1) == [3]


def test_longer_n_preferred():
    # [4, 5] last occurs before 9 but the 3-gram [3, 4, 5] only before 1
    assert NgramProposer(1, 3).propose([3, 4, 5, 1, 0, 4, 5, 9, 3, 4, 5], 2) == [1, 0]
    assert NgramProposer(1, 2).propose([3, 4, 5, 1, 0, 4, 5, 9, 3, 4, 5], 2) == [9, 3]


def test_k_truncated_at_end_of_context():
    # the proposal never reaches past the current end, even when the match overlaps the pattern
    assert NgramProposer(1, 1).propose([1, 2, 3, 1], 10) == [2, 3, 1]
    assert NgramProposer(2, 2).propose([1, 1, 1, 1], 5) == [1]
    assert NgramProposer(1, 3).propose([1, 2, 3, 1, 2, 3], 2) == [1, 2]


def test_min_equals_max_and_short_sequences():
    assert NgramProposer(3, 3).propose([1, 2, 1, 2], 3) == []  # only the 2-gram matches
    assert NgramProposer(2, 2).propose([1, 2, 1, 2], 3) == [1, 2]
    assert NgramProposer(3, 5).propose([1, 1, 1], 2) == []  # shorter than or equal to every n tried
    assert NgramProposer(1, 5).propose([1, 1], 2) == [1]
    assert NgramProposer(1, 1).propose([4], 2) == []
    assert NgramProposer(1, 1).propose([], 2) == []


def test_k_nonpositive():
    assert NgramProposer(1, 2).propose([1, 2, 1], 0) == []
    assert NgramProposer(1, 2).propose([1, 2, 1], -3) == []


def test_list_and_numpy_inputs_agree():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3]
    proposer = NgramProposer(1, 3)
    expected = [9, 9, 1]
    assert proposer.propose(tokens, 3) == expected
    assert proposer.propose(tuple(tokens), 3) == expected
    for dtype in (np.int32, np.int64, np.uint32):
        assert proposer.propose(np.array(tokens, dtype=dtype), 3) == expected


def test_propose_batch():
    proposer = NgramProposer(1, 2)
    seqs = [[1, 2, 1], np.array([5, 6, 7]), [3, 4, 3, 4], []]
    assert proposer.propose_batch(seqs, [2, 2, 1, 3]) == [[2, 1], [], [3], []]
    with pytest.raises(ValueError):
        proposer.propose_batch(seqs, [1])


def test_invalid_n():
    with pytest.raises(ValueError):
        NgramProposer(0, 2)
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    for length in (4096, 32768):
        for label, vocab in (("natural-ish vocab 32k", 32000), ("repetitive vocab 50", 50)):
            tokens = rng.integers(0, vocab, length, dtype=np.int64)
            proposer = NgramProposer(1, 4)
            reps = 200
            begin = time.perf_counter()
            for _ in range(reps):
                proposer.propose(tokens, 5)
            per = (time.perf_counter() - begin) / reps
            as_list = tokens.tolist()
            begin = time.perf_counter()
            for _ in range(20):
                proposer.propose(as_list, 5)
            per_list = (time.perf_counter() - begin) / 20
            print(f"{length:6d} tokens, {label}: {per * 1e6:8.1f} us (ndarray), {per_list * 1e6:8.1f} us (list)")
