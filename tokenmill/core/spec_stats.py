"""Speculative-decoding statistics: the counters the scheduler keeps as it verifies drafts. No torch here."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Verification counters, vLLM's spec_decode_* metrics: drafts (verifications with at least one draft),
    draft tokens, accepted tokens, and accepted tokens by draft position."""

    max_k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.max_k

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for i in range(min(accepted, self.max_k)):
            self.accepted_per_pos[i] += 1

    def as_dict(self) -> dict:
        drafted, accepted = self.num_draft_tokens, self.num_accepted_tokens
        return {"num_drafts": self.num_drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
                "accepted_per_pos": list(self.accepted_per_pos),
                "acceptance_rate": accepted / drafted if drafted else None,
                "mean_acceptance_length": 1 + accepted / self.num_drafts if self.num_drafts else None}

