"""N-gram (prompt lookup) draft proposer for speculative decoding."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenmill.spec_decode.draft import Draft, StepView


class NgramProposer:
    """Prompt lookup decoding: find the most recent earlier occurrence of the context's last n tokens
    (n from max_n down to min_n) and propose the up-to-k tokens that followed it.

    One vectorised pass finds every earlier position holding the context's last token; those candidates
    are then narrowed backwards one token at a time, keeping the survivors of each length, so every n is
    answered without a further scan of the context.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int] | np.ndarray, k: int) -> list[int]:
        arr = np.asarray(token_ids)
        length = arr.shape[0]
        top_n = min(self.max_n, length - 1)  # n >= len is skipped
        if k <= 0 or top_n < self.min_n:
            return []
        # End positions of earlier occurrences of the last token (strictly before the last position).
        ends = np.flatnonzero(arr[: length - 1] == arr[-1])
        survivors = [ends]  # survivors[n - 1]: ends of occurrences of the last n tokens, ascending
        for j in range(1, top_n):
            ends = ends[np.searchsorted(ends, j) :]  # the occurrence must start at index >= 0
            ends = ends[arr[ends - j] == arr[length - 1 - j]]
            if ends.size == 0:
                break
            survivors.append(ends)
        for n in range(min(top_n, len(survivors)), self.min_n - 1, -1):
            if survivors[n - 1].size:
                start = int(survivors[n - 1][-1]) + 1
                return arr[start : start + k].tolist()
        return []

    def propose_batch(self, seqs: list[Sequence[int] | np.ndarray], ks: list[int]) -> list[list[int]]:
        if len(seqs) != len(ks):
            raise ValueError(f"{len(seqs)} sequences but {len(ks)} values of k")
        return [self.propose(seq, k) for seq, k in zip(seqs, ks)]


class NgramDrafter:
    """Prompt lookup over each request's tokens, kept in a growing numpy buffer (no list copy per step)."""

    shape = "chain"  # what its k means to the adaptive policy (adaptive.py)

    def __init__(self, min_n: int, max_n: int) -> None:
        self.proposer = NgramProposer(min_n, max_n)
        self.history: dict[str, tuple[np.ndarray, int]] = {}

    def _tokens(self, view: StepView, i: int) -> np.ndarray:
        """Request i's tokens as a numpy view; only those new since the last step are copied in."""
        rid, total = view.requests[i].req_id, view.length(i)
        buf, n = self.history.get(rid, (None, 0))
        if buf is None or n > total:
            buf, n = np.empty(max(64, 2 * total), dtype=np.int64), 0
        if total > buf.size:
            grown = np.empty(2 * total, dtype=np.int64)
            grown[:n] = buf[:n]
            buf = grown
        buf[n:total] = view.tokens(i, n, total)
        self.history[rid] = (buf, total)
        return buf[:total]

    def forget(self, rid: str) -> None:
        self.history.pop(rid, None)

    def propose(self, view: StepView, want: set[int], k: int) -> dict[int, Draft]:
        out = {}
        for i in want:
            drafts = self.proposer.propose(self._tokens(view, i), k)
            if drafts:
                out[i] = Draft(drafts, None)
        return out
